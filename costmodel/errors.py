"""The model file's name and its error, shared by the current reader (:mod:`.persist`) and the
converter of old files (:mod:`.legacy`)."""

#: The ``format`` field of every model file's metadata.
MODEL_FORMAT = "fasttree-latency-model"


class ModelFileError(ValueError):
    """A model file that cannot be used here: malformed, or for another GPU or feature schema."""
