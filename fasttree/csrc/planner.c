/* Native cores of the host planner (fasttree.native loads this file with ctypes).
 *
 * Each function reproduces one numpy/Python path of fasttree.planner operation for operation
 * (the same float64 expressions in the same order), so a plan is bit-identical whichever path
 * made it; tests/test_native.py compares them on random trees and forests.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Python's (-x) % t for x >= 0, t > 0; mask = t - 1 when t is a power of two (then no division:
 * a 64-bit division costs tens of cycles), else -1. */
static inline int64_t neg_mod(int64_t x, int64_t t, int64_t mask) {
    return mask >= 0 ? (-x) & mask : (t - x % t) % t;
}

static inline int64_t pow2_mask(int64_t t) { return t > 0 && (t & (t - 1)) == 0 ? t - 1 : -1; }

/* log2(t) when t >= 1 is a power of two, else -1: then x / t and x % t (x >= 0) by shift_div and
 * shift_mod are a shift and a mask, no division. */
static inline int exact_log2(int64_t t) {
    if (t < 1 || (t & (t - 1)))
        return -1;
    int s = 0;
    while (((int64_t)1 << s) < t) s++;
    return s;
}
static inline int64_t shift_div(int64_t x, int64_t t, int sh) { return sh >= 0 ? x >> sh : x / t; }
static inline int64_t shift_mod(int64_t x, int64_t t, int sh) { return sh >= 0 ? x & (t - 1) : x % t; }

/* The greedy binary edge assignment over a tree's edges in edge order (by depth, parent, id):
 * fasttree.planner._greedy_all_scalar / _greedy_scalar. Per edge e: its parent's node id cp[e],
 * the child's queries q[e] and length lnf[e], the parent's queries n_par[e]; the parent's group
 * length is root_len[e] when par_edge[e] < 0 (a root), else eff[par_edge[e]] (an earlier edge's
 * result). Writes dec[e] (1: concatenated) and eff[e] (the child's group length). */
static void ft_greedy(int64_t n_edges, const int64_t *cp, const int64_t *q, const double *lnf, const int64_t *n_par,
                      const int64_t *par_edge, const double *root_len, double ag, double bg, double gamma,
                      int64_t tq0, int64_t tq1, int64_t tk0, int64_t tk1, int8_t *dec, double *eff) {
    int64_t prev = -2, n = 0;
    const int64_t m0 = pow2_mask(tq0), m1 = pow2_mask(tq1);
    double cn = 0.0, pk0 = 0.0, pk1 = 0.0;
    for (int64_t e = 0; e < n_edges; e++) {
        const int64_t p = cp[e], qe = q[e];
        const double ln = lnf[e];
        const double lv = par_edge[e] < 0 ? root_len[e] : eff[par_edge[e]];
        /* Cmm(q, len_child) and gamma * q of the edge (as _greedy_all_scalar computes them) */
        const int big = qe > tq1;
        const double pad_kc = (double)(big ? tk0 : tk1) - ln;
        double cc = (double)neg_mod(qe, big ? tq0 : tq1, big ? m0 : m1) * ln * ag;
        cc += (pad_kc > 0.0 ? pad_kc : 0.0) * (double)qe * bg;
        const double gq = gamma * (double)qe;
        if (p != prev) {
            prev = p;
            n = n_par[e];
            pk0 = lv < (double)tk0 ? (double)tk0 - lv : 0.0;
            pk1 = lv < (double)tk1 ? (double)tk1 - lv : 0.0;
            if (n > tq1)
                cn = ag * ((double)neg_mod(n, tq0, m0) * lv) + bg * (pk0 * (double)n);
            else
                cn = ag * ((double)neg_mod(n, tq1, m1) * lv) + bg * (pk1 * (double)n);
        }
        const int64_t m = n - qe;
        double cm;
        if (m > tq1)
            cm = ag * ((double)neg_mod(m, tq0, m0) * lv) + bg * (pk0 * (double)m);
        else
            cm = ag * ((double)neg_mod(m, tq1, m1) * lv) + bg * (pk1 * (double)m);
        const double t = ln + lv;
        double ccat;
        if (qe > tq1)
            ccat = ag * ((double)neg_mod(qe, tq0, m0) * t) + bg * ((t < (double)tk0 ? (double)tk0 - t : 0.0) * (double)qe);
        else
            ccat = ag * ((double)neg_mod(qe, tq1, m1) * t) + bg * ((t < (double)tk1 ? (double)tk1 - t : 0.0) * (double)qe);
        if (cn + cc + gq > cm + ccat) {
            dec[e] = 1;
            eff[e] = t;
            n = m;
            cn = cm;
        } else {
            dec[e] = 0;
            eff[e] = ln;
        }
    }
}

/* The greedy (ft_greedy) and its groups (fasttree.planner.greedy_edge_assignment and _Kept):
 * with n_nodes nodes, subtree_queries sq and lengths len [n_nodes], and each edge's child node
 * ch[e] and parent cp[e] (edges by depth, parent, id), the greedy's per-edge inputs derived here
 * (the child's queries and length, the parent's queries, the parent's edge, a root parent's
 * length, as the numpy greedy reads them from fasttree.planner._TreeIndex), then assign[v] (1: the edge into v is concatenated, 0
 * for roots), group_q[v] (queries left in v's group: sq[v] minus its concatenated children's),
 * group_kv[v] (v's group's tokens: the child's group length of its edge as int64, else len[v]),
 * and the kept groups (>= 1 query and >= 1 token) in node order: node, count (group_q) and kv
 * (group_kv) [n_kept], n_kept in *kept, and keep[v] (1: v's group is kept). work: int64 [n_nodes
 * + 3 * n_edges] and fwork: double [3 * n_edges] scratch; dec: int8 [n_edges] scratch. Returns 0,
 * or -1 when a child or parent id is out of range. */
int64_t ft_greedy_groups(int64_t n_nodes, int64_t n_edges, const int64_t *ch, const int64_t *cp, const int64_t *sq,
                         const int64_t *len, double ag, double bg, double gamma, int64_t tq0, int64_t tq1, int64_t tk0,
                         int64_t tk1, int64_t *work, double *fwork, int8_t *dec, int8_t *assign, int64_t *group_q,
                         int64_t *group_kv, int8_t *keep, int64_t *node, int64_t *count, int64_t *kv, int64_t *kept) {
    int64_t *edge_of = work, *q = work + n_nodes, *n_par = q + n_edges, *par_edge = n_par + n_edges;
    double *lnf = fwork, *root_len = fwork + n_edges, *eff = fwork + 2 * n_edges;
    for (int64_t v = 0; v < n_nodes; v++) edge_of[v] = -1;
    for (int64_t e = 0; e < n_edges; e++) {
        if (ch[e] < 0 || ch[e] >= n_nodes || cp[e] < 0 || cp[e] >= n_nodes)
            return -1;
        edge_of[ch[e]] = e;
    }
    for (int64_t e = 0; e < n_edges; e++) {
        const int64_t c = ch[e], p = cp[e];
        q[e] = sq[c];
        n_par[e] = sq[p];
        lnf[e] = (double)len[c];
        par_edge[e] = edge_of[p];
        root_len[e] = par_edge[e] < 0 ? (double)len[p] : 0.0;
    }
    ft_greedy(n_edges, cp, q, lnf, n_par, par_edge, root_len, ag, bg, gamma, tq0, tq1, tk0, tk1, dec, eff);
    for (int64_t v = 0; v < n_nodes; v++) {
        assign[v] = 0;
        group_q[v] = sq[v];
        group_kv[v] = len[v];
    }
    for (int64_t e = 0; e < n_edges; e++) {
        const int64_t v = ch[e];
        assign[v] = dec[e];
        group_kv[v] = (int64_t)eff[e];
        if (dec[e])
            group_q[cp[e]] -= q[e];
    }
    int64_t k = 0;
    for (int64_t v = 0; v < n_nodes; v++)
        if ((keep[v] = group_q[v] > 0 && group_kv[v] > 0)) {
            node[k] = v;
            count[k] = group_q[v];
            kv[k++] = group_kv[v];
        }
    *kept = k;
    return 0;
}

/* The 1-chains of the chained groups (fasttree.planner._chain_layout): chain c starts at node
 * nodes[c] (whose edge is concatenated) and takes its parent, then the parent's parent, ...,
 * up to and including the first node whose own edge is not concatenated (assign != 1) or a root.
 * ft_chain_lengths writes each chain's tokens to total[c]; ft_chain_fill copies each chain's
 * slot runs, top of the chain first, into out[first[c] ...] (scratch: room for the deepest chain). */
void ft_chain_lengths(int64_t n, const int64_t *nodes, const int64_t *parents, const int8_t *assign,
                      const int64_t *lengths, int64_t *total) {
    for (int64_t c = 0; c < n; c++) {
        int64_t v = nodes[c], sum = lengths[v];
        while (assign[v] == 1 && parents[v] >= 0) {
            v = parents[v];
            sum += lengths[v];
        }
        total[c] = sum;
    }
}

/* Every group's KV start (fasttree.planner._chain_layout): group g of node nodes[g] reads its
 * node's run of the tree's slots (slot_indptr) unless its edge is concatenated (assign == 1):
 * then its chain's slots, laid out after the n_slots of the tree, chains in group order. Writes
 * kv_start [n_groups], the chained groups' nodes (heads) and their chains' offsets past n_slots
 * (first), counts[0] = chains, counts[1] = their entries and counts[2] = their nodes. Returns 0,
 * or -1 when a node is out of range. */
int64_t ft_chain_layout(int64_t n_groups, const int64_t *nodes, int64_t n_nodes, const int8_t *assign,
                        const int64_t *parents, const int64_t *lengths, const int64_t *slot_indptr, int64_t n_slots,
                        int64_t *kv_start, int64_t *heads, int64_t *first, int64_t *counts) {
    int64_t k = 0, acc = 0, n_chain_nodes = 0;
    for (int64_t g = 0; g < n_groups; g++) {
        int64_t v = nodes[g];
        if (v < 0 || v >= n_nodes)
            return -1;
        if (assign[v] != 1) {
            kv_start[g] = slot_indptr[v];
            continue;
        }
        heads[k] = v;
        first[k++] = acc;
        kv_start[g] = n_slots + acc;
        int64_t sum = lengths[v];
        n_chain_nodes++;
        while (assign[v] == 1 && parents[v] >= 0) {
            v = parents[v];
            sum += lengths[v];
            n_chain_nodes++;
        }
        acc += sum;
    }
    counts[0] = k;
    counts[1] = acc;
    counts[2] = n_chain_nodes;
    return 0;
}

/* The nodes of the chain that starts at node v, bottom first, into scratch; returns their count. */
static inline int64_t chain_nodes(int64_t v, const int64_t *parents, const int8_t *assign, int64_t *scratch) {
    int64_t k = 0;
    scratch[k++] = v;
    while (assign[v] == 1 && parents[v] >= 0) {
        v = parents[v];
        scratch[k++] = v;
    }
    return k;
}

void ft_chain_fill(int64_t n, const int64_t *nodes, const int64_t *parents, const int8_t *assign,
                   const int64_t *slot_indptr, const int64_t *lengths, const int32_t *slots, const int64_t *first,
                   int64_t *scratch, int32_t *out) {
    for (int64_t c = 0; c < n; c++) {
        const int64_t k = chain_nodes(nodes[c], parents, assign, scratch);
        int32_t *dst = out + first[c];
        for (int64_t s = k - 1; s >= 0; s--) {
            const int64_t u = scratch[s], len = lengths[u];
            const int32_t *src = slots + slot_indptr[u];
            for (int64_t i = 0; i < len; i++) dst[i] = src[i];
            dst += len;
        }
    }
}

/* The chains of ft_chain_fill as runs of the tree's slots instead of copies: run k (chains in
 * order, each top of the chain first) is node u's slots, src[k] = slot_indptr[u], and starts at
 * off[k] of the chains' concatenation; off[n_runs] = its entries. src and off hold the chains'
 * nodes (ft_chain_layout's counts[2]) and one more. */
void ft_chain_runs(int64_t n, const int64_t *nodes, const int64_t *parents, const int8_t *assign,
                   const int64_t *slot_indptr, const int64_t *lengths, int64_t *scratch, int64_t *src, int64_t *off) {
    int64_t r = 0, acc = 0;
    for (int64_t c = 0; c < n; c++) {
        const int64_t k = chain_nodes(nodes[c], parents, assign, scratch);
        for (int64_t s = k - 1; s >= 0; s--, r++) {
            const int64_t u = scratch[s];
            src[r] = slot_indptr[u];
            off[r] = acc;
            acc += lengths[u];
        }
    }
    off[r] = acc;
}

/* out = the concatenation of kv_slots[start[i] : start[i] + length[i]] over the runs
 * (fasttree.packing._gather_runs). */
void ft_gather_runs(int64_t n_runs, const int32_t *kv_slots, const int64_t *start, const int64_t *length,
                    int32_t *out) {
    for (int64_t i = 0; i < n_runs; i++) {
        const int32_t *src = kv_slots + start[i];
        const int64_t len = length[i];
        for (int64_t k = 0; k < len; k++) out[k] = src[k];
        out += len;
    }
}

/* The KV tokens a laid-out plan reads, all and in the small tile class, before its arrays
 * (fasttree.plan_arrays._laid_out_weighted_reads): units in no bin count in the small class with at
 * most small_queries queries; bins (pieces in bin order, new_bin marking each first piece) with
 * rows <= small_rows, a bin's rows being its highest served position + 1 counted from its block's
 * start (start_of_rank, or fixed blocks of capacity ranks when NULL). keep: n_units scratch.
 * Writes out[0] (all) and out[1] (small); returns 0, or -1 on an index out of range. */
int64_t ft_layout_class_reads(int64_t n_units, const int64_t *kv_len, const int64_t *q_len, int64_t small_queries,
                              int64_t n_pieces, const int64_t *unit, const int64_t *lowest, const int64_t *bits,
                              const int8_t *new_bin, const int64_t *tokens, int64_t n_queries, int64_t capacity,
                              const int64_t *start_of_rank, int64_t small_rows, int8_t *keep, int64_t *out) {
    if (capacity < 1 || (n_pieces && !new_bin[0])) return -1;
    for (int64_t u = 0; u < n_units; u++) keep[u] = 1;
    for (int64_t p = 0; p < n_pieces; p++) {
        if (unit[p] < 0 || unit[p] >= n_units) return -1;
        keep[unit[p]] = 0;
    }
    int64_t total = 0, small = 0;
    for (int64_t u = 0; u < n_units; u++)
        if (keep[u]) {
            total += kv_len[u];
            if (q_len[u] <= small_queries) small += kv_len[u];
        }
    int64_t p = 0;
    while (p < n_pieces) {
        uint64_t b_bits = (uint64_t)bits[p];
        int64_t b_tokens = tokens[p], e = p + 1;
        for (; e < n_pieces && !new_bin[e]; e++) {
            b_bits |= (uint64_t)bits[e];
            b_tokens += tokens[e];
        }
        const int64_t r = lowest[p];
        if (r < 0 || r >= n_queries) return -1;
        const int64_t base = start_of_rank ? r - start_of_rank[r] : shift_mod(r, capacity, exact_log2(capacity));
        if (base < 0 || base > 63) return -1;
        int64_t rows = 0;
        for (uint64_t b = b_bits >> base; b; b >>= 1) rows++;
        total += b_tokens;
        if (rows <= small_rows) small += b_tokens;
        p = e;
    }
    out[0] = total;
    out[1] = small;
    return 0;
}

/* A stable counting sort of idx[0..n) by key[idx[i]] in [0, range): writes the sorted indices to
 * out (count: scratch of range + 1 entries). */
static void counting_sort(int64_t n, const int64_t *idx, const int64_t *key, int64_t range, int64_t *count,
                          int64_t *out) {
    for (int64_t k = 0; k <= range; k++) count[k] = 0;
    for (int64_t i = 0; i < n; i++) count[key[idx[i]] + 1]++;
    for (int64_t k = 0; k < range; k++) count[k + 1] += count[k];
    for (int64_t i = 0; i < n; i++) out[count[key[idx[i]]]++] = idx[i];
}

/* x[i] = (x[i] * m) / t (t > 0, the products non-negative) for x that mostly rise in small steps:
 * a quotient is divided out only where the product leaves the last quotient's range of t values
 * (a 64-bit division costs tens of cycles; a run of budget tokens holds several pieces). */
static void run_quotients(int64_t n, int64_t *x, int64_t m, int64_t t) {
    int64_t q = 0, lo = 0, hi = t;
    for (int64_t i = 0; i < n; i++) {
        const int64_t v = x[i] * m;
        if (v < lo || v >= hi) {
            q = v / t;
            lo = q * t;
            hi = lo + t;
        }
        x[i] = q;
    }
}

/* int64 entries of ft_bin_members' scratch: 9 per pair and 2 per value of its counting sorts' keys
 * (units, blocks, ranks: at most max(n_units, n_queries + 1)), plus one. */
#define BIN_MEMBERS_SCRATCH(n_pairs, n_units, n_queries) \
    (9 * (n_pairs) + 2 * ((n_units) > (n_queries) + 1 ? (n_units) : (n_queries) + 1) + 1)

/* The bins' member pieces of fasttree.packing._bin_members (its _cut_into_pieces and _run_starts
 * with the same integer arithmetic): the candidates' pairs (c_unit nondecreasing, c_rank each
 * pair's query rank) are cut at block boundaries (fixed blocks of capacity ranks when
 * block_of_rank is NULL), the pieces sorted by lowest rank and cut into runs of budget tokens
 * (balanced: round(T / budget) runs of about equal tokens per block of T tokens); runs of one
 * piece of an uncut unit are dropped. Writes the members (at most n_pairs) in bin order and
 * *some_cut (a unit became two pieces or more); returns the member count. scratch: int64
 * [BIN_MEMBERS_SCRATCH(n_pairs, n_units, n_queries)], the caller's work memory. */
int64_t ft_bin_members(int64_t n_pairs, const int64_t *c_unit, const int64_t *c_rank, int64_t n_queries,
                       int64_t n_units, int64_t capacity, const int64_t *block_of_rank, const int64_t *start_of_rank,
                       const int64_t *kv_len, int64_t budget, int64_t balanced, int64_t *o_unit, int64_t *o_lowest,
                       int64_t *o_bits, int8_t *o_new_run, int64_t *o_tokens, int64_t *some_cut, int64_t *scratch) {
    /* blocks: at most n_queries / capacity + 1 fixed ones, or block_of_rank[n_queries - 1] + 2 <= n_queries + 1 */
    const int64_t n_blocks = block_of_rank ? block_of_rank[n_queries - 1] + 2 : n_queries / capacity + 1;
    int64_t range = n_blocks > n_units ? n_blocks : n_units;
    if (n_queries > range) range = n_queries;
    const int csh = exact_log2(capacity);
    int64_t *buf = scratch;
    int64_t *c_block = buf, *c_pos = buf + n_pairs, *order = buf + 2 * n_pairs, *tmp = buf + 3 * n_pairs;
    int64_t *p_unit = buf + 4 * n_pairs, *p_lowest = buf + 5 * n_pairs, *p_bits = buf + 6 * n_pairs;
    int64_t *p_cut = buf + 7 * n_pairs, *p_order = buf + 8 * n_pairs, *count = buf + 9 * n_pairs;
    int64_t *piece_of_block = count + range + 1; /* [n_blocks]: the current unit's piece of a block, or -1 */
    int units_sorted = 1;
    for (int64_t i = 0; i < n_pairs; i++) {
        const int64_t r = c_rank[i];
        if (block_of_rank) {
            c_block[i] = block_of_rank[r];
            c_pos[i] = r - start_of_rank[r];
        } else {
            c_block[i] = shift_div(r, capacity, csh);
            c_pos[i] = shift_mod(r, capacity, csh);
        }
        order[i] = i;
        if (i && c_unit[i] < c_unit[i - 1])
            units_sorted = 0;
    }
    /* pieces: the pairs of one unit in one block, in (unit, block) order */
    int64_t n_pieces = 0, any_cut = 0;
    if (units_sorted) {
        /* each unit's pairs merged into its pieces as they come (a unit touches a few blocks),
         * the pieces kept in block order: no sort of the pairs */
        int64_t *p_block = order;
        for (int64_t b = 0; b < n_blocks; b++) piece_of_block[b] = -1;
        for (int64_t first = 0; first < n_pairs;) {
            int64_t end = first + 1;
            while (end < n_pairs && c_unit[end] == c_unit[first]) end++;
            const int64_t p0 = n_pieces;
            int64_t in_order = 1;
            for (int64_t i = first; i < end; i++) {
                const int64_t b = c_block[i];
                const int64_t p = piece_of_block[b];
                if (p >= 0) {
                    if (c_rank[i] < p_lowest[p]) p_lowest[p] = c_rank[i];
                    p_bits[p] |= (int64_t)1 << c_pos[i];
                    continue;
                }
                if (n_pieces > p0 && p_block[n_pieces - 1] > b) in_order = 0;
                piece_of_block[b] = n_pieces;
                p_unit[n_pieces] = c_unit[i]; /* every piece of the unit has its unit and no cut yet */
                p_cut[n_pieces] = 0;
                p_block[n_pieces] = b;
                p_lowest[n_pieces] = c_rank[i];
                p_bits[n_pieces++] = (int64_t)1 << c_pos[i];
            }
            for (int64_t p = p0; p < n_pieces; p++) piece_of_block[p_block[p]] = -1;
            if (!in_order) /* the unit's pieces in block order (a unit touches a few blocks) */
                for (int64_t p = p0 + 1; p < n_pieces; p++) {
                    const int64_t b = p_block[p], low = p_lowest[p], bits = p_bits[p];
                    int64_t k = p;
                    for (; k > p0 && p_block[k - 1] > b; k--) {
                        p_block[k] = p_block[k - 1];
                        p_lowest[k] = p_lowest[k - 1];
                        p_bits[k] = p_bits[k - 1];
                    }
                    p_block[k] = b;
                    p_lowest[k] = low;
                    p_bits[k] = bits;
                }
            first = end;
        }
    } else {
        /* stable by (unit, block): by block, then by unit; pieces are runs of equal (unit, block) */
        counting_sort(n_pairs, order, c_block, n_blocks, count, tmp);
        counting_sort(n_pairs, tmp, c_unit, n_units, count, order);
        for (int64_t j = 0; j < n_pairs; j++) {
            const int64_t i = order[j];
            if (j == 0 || c_unit[i] != p_unit[n_pieces - 1] || c_block[i] != c_block[order[j - 1]]) {
                p_unit[n_pieces] = c_unit[i];
                p_lowest[n_pieces] = c_rank[i];
                p_bits[n_pieces] = (int64_t)1 << c_pos[i];
                p_cut[n_pieces] = 0;
                n_pieces++;
            } else {
                if (c_rank[i] < p_lowest[n_pieces - 1]) p_lowest[n_pieces - 1] = c_rank[i];
                p_bits[n_pieces - 1] |= (int64_t)1 << c_pos[i];
            }
        }
    }
    for (int64_t p = 1; p < n_pieces; p++)
        if (p_unit[p] == p_unit[p - 1]) p_cut[p] = p_cut[p - 1] = any_cut = 1;
    /* by lowest rank, ties in (unit, block) order (pieces often come so already) */
    int64_t rank_sorted = 1;
    for (int64_t p = 0; p < n_pieces; p++) {
        tmp[p] = p;
        if (p && p_lowest[p] < p_lowest[p - 1])
            rank_sorted = 0;
    }
    if (rank_sorted)
        for (int64_t p = 0; p < n_pieces; p++) p_order[p] = p;
    else
        counting_sort(n_pieces, tmp, p_lowest, n_queries, count, p_order);
    /* runs within blocks: tokens before each piece in its block, then the run boundaries */
    int64_t *blk = c_block, *excl = c_pos; /* reused: n_pieces <= n_pairs */
    int64_t *tok = tmp;
    for (int64_t j = 0; j < n_pieces; j++) {
        const int64_t p = p_order[j], low = p_lowest[p];
        blk[j] = block_of_rank ? block_of_rank[low] : shift_div(low, capacity, csh);
        tok[j] = kv_len[p_unit[p]];
    }
    int64_t acc = 0;
    for (int64_t j = 0; j < n_pieces; j++) {
        if (j == 0 || blk[j] != blk[j - 1]) acc = 0;
        excl[j] = acc;
        acc += tok[j];
    }
    if (balanced) {
        int64_t j = 0;
        while (j < n_pieces) {
            int64_t e = j + 1, total = tok[j];
            while (e < n_pieces && blk[e] == blk[j]) total += tok[e++];
            int64_t n_runs = (2 * total + budget) / (2 * budget);
            if (n_runs < 1) n_runs = 1;
            /* numpy's floor division (non-negative here); by a zero total it gives 0 */
            if (total)
                run_quotients(e - j, excl + j, n_runs, total);
            else
                for (int64_t k = j; k < e; k++) excl[k] = 0;
            j = e;
        }
    } else {
        run_quotients(n_pieces, excl, 1, budget);
    }
    /* new runs, then the pieces of runs that become bins */
    int64_t n_out = 0;
    for (int64_t j = 0; j < n_pieces; j++) {
        const int start = j == 0 || blk[j] != blk[j - 1] || excl[j] != excl[j - 1];
        const int next_start = j + 1 == n_pieces || blk[j + 1] != blk[j] || excl[j + 1] != excl[j];
        const int64_t p = p_order[j];
        if (start && next_start && !p_cut[p]) continue; /* a lone piece of an uncut unit */
        o_unit[n_out] = p_unit[p];
        o_lowest[n_out] = p_lowest[p];
        o_bits[n_out] = p_bits[p];
        o_new_run[n_out] = (int8_t)start;
        o_tokens[n_out] = tok[j];
        n_out++;
    }
    *some_cut = any_cut;
    return n_out;
}

/* The packed units' KV row masks (fasttree.packing._assemble): -1 (every row) for the first n_old
 * entries, then each piece's bits (as int32: bit 31 is the sign bit) for its tokens. */
void ft_fill_mask(int64_t n_old, int64_t n_pieces, const int64_t *bits, const int64_t *tokens, int32_t *out) {
    for (int64_t i = 0; i < n_old; i++) out[i] = -1;
    out += n_old;
    for (int64_t p = 0; p < n_pieces; p++) {
        const int32_t v = (int32_t)(uint32_t)bits[p];
        const int64_t n = tokens[p];
        for (int64_t k = 0; k < n; k++) out[k] = v;
        out += n;
    }
}

/* Sorts ids[0..n) (non-negative) in place: nothing when they are in order, an insertion sort up to
 * 32, else an LSD radix sort of their bytes through *scratch (grown to n entries as needed).
 * Returns 0, or -1 out of memory. */
static int sort_ids(int64_t *ids, int64_t n, int64_t **scratch, int64_t *scratch_size) {
    int64_t i = 1;
    while (i < n && ids[i - 1] <= ids[i]) i++;
    if (i >= n)
        return 0;
    if (n <= 32) {
        for (; i < n; i++) {
            const int64_t v = ids[i];
            int64_t j = i;
            for (; j > 0 && ids[j - 1] > v; j--) ids[j] = ids[j - 1];
            ids[j] = v;
        }
        return 0;
    }
    if (*scratch_size < n) {
        int64_t *grown = realloc(*scratch, sizeof(int64_t) * (size_t)n);
        if (!grown)
            return -1;
        *scratch = grown;
        *scratch_size = n;
    }
    int64_t largest = 0, count[257];
    for (int64_t k = 0; k < n; k++) largest = ids[k] > largest ? ids[k] : largest;
    int64_t *src = ids, *dst = *scratch;
    for (int shift = 0; shift < 64 && (largest >> shift) > 0; shift += 8) {
        for (int b = 0; b <= 256; b++) count[b] = 0;
        for (int64_t k = 0; k < n; k++) count[((src[k] >> shift) & 255) + 1]++;
        for (int b = 0; b < 256; b++) count[b + 1] += count[b];
        for (int64_t k = 0; k < n; k++) dst[count[(src[k] >> shift) & 255]++] = src[k];
        int64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != ids)
        for (int64_t k = 0; k < n; k++) ids[k] = src[k];
    return 0;
}

/* The kept groups' query lists (fasttree.planner._build_groups): group g (node nodes[g], nodes
 * ascending, count[g] queries) holds the DFS positions qlo[v] .. qhi[v] minus the ranges of its
 * hole children: its children (cs: the non-root nodes by parent, then id) whose edge is
 * concatenated (assign != 0). Writes q_indptr [n_groups + 1] (the exclusive sum of count) and the
 * lists at q_ids[q_indptr[g] ...] as query ids: perm[position] sorted within the group, or the
 * positions themselves when perm is NULL. Returns 0, -1 (nothing past the group written) when
 * the counts do not add up to n_ids or a group's positions do not number count[g], or -2 out of
 * memory. */
int64_t ft_group_queries(int64_t n_groups, const int64_t *nodes, const int64_t *count, int64_t n_cs,
                         const int64_t *cs, const int8_t *assign, const int64_t *parents, const int64_t *qlo,
                         const int64_t *qhi, const int64_t *perm, int64_t n_ids, int64_t *q_indptr, int64_t *q_ids) {
    q_indptr[0] = 0;
    for (int64_t g = 0; g < n_groups; g++) q_indptr[g + 1] = q_indptr[g] + count[g];
    if (q_indptr[n_groups] != n_ids)
        return -1;
    int64_t h = 0, scratch_size = 0, *scratch = NULL;
    for (int64_t g = 0; g < n_groups; g++) {
        const int64_t v = nodes[g];
        while (h < n_cs && parents[cs[h]] < v) h++;
        int64_t end = h, n = qhi[v] - qlo[v];
        for (; end < n_cs && parents[cs[end]] == v; end++)
            if (assign[cs[end]]) n -= qhi[cs[end]] - qlo[cs[end]];
        if (n != count[g]) {
            free(scratch);
            return -1;
        }
        int64_t *out = q_ids + q_indptr[g];
        int64_t pos = qlo[v];
        for (; h < end; h++) {
            const int64_t c = cs[h];
            if (!assign[c]) continue;
            for (int64_t p = pos; p < qlo[c]; p++) *out++ = perm ? perm[p] : p;
            pos = qhi[c];
        }
        for (int64_t p = pos; p < qhi[v]; p++) *out++ = perm ? perm[p] : p;
        if (perm && sort_ids(q_ids + q_indptr[g], n, &scratch, &scratch_size))
            return -2;
    }
    free(scratch);
    return 0;
}

/* The bins of fasttree.packing._assemble: piece p (of unit[p], lowest rank lowest[p], position
 * bits bits[p], tokens[p] entries) starts a bin where new_bin[p]. A bin's rows start at its first
 * piece's position in its block (the lowest rank modulo capacity, or minus start_of_rank of it);
 * each piece's bits are shifted down by its bin start's position (the running maximum of the bin
 * starts' lowest ranks, as numpy's maximum.accumulate), the bin's OR of them by its own. */
static inline int64_t block_pos(int64_t rank, int64_t capacity, const int64_t *start_of_rank) {
    if (start_of_rank)
        return rank - start_of_rank[rank];
    return (capacity & (capacity - 1)) == 0 ? rank & (capacity - 1) : rank % capacity; /* rank >= 0 */
}

static int64_t bit_length(int64_t x) {
    int64_t n = 0;
    while (x > 0) {
        n++;
        x >>= 1;
    }
    return n;
}

/* First pass: checks every index and writes sizes[0..6) = bins, kept units, kept entries, bin
 * entries, kept pairs, bin pairs; keep[u] = 1 for a unit no piece took. Returns 0, or -1 when an
 * index is out of range (a piece's unit, rank or KV run; a shift past 63 bits). */
int64_t ft_assemble_sizes(int64_t n_units, const int64_t *kv_start, const int64_t *kv_len, const int64_t *q_len,
                          int64_t n_slots, int64_t n_queries, int64_t capacity, const int64_t *start_of_rank,
                          int64_t n_pieces, const int64_t *unit, const int64_t *lowest, const int64_t *bits,
                          const int8_t *new_bin, const int64_t *tokens, int8_t *keep, int64_t *sizes) {
    int64_t bins = 0, b_total = 0, b_pairs = 0, run_max = 0, b_bits = 0, b_base = 0;
    if (capacity < 1 || (n_pieces && !new_bin[0]))
        return -1;
    for (int64_t u = 0; u < n_units; u++) keep[u] = 1;
    for (int64_t p = 0; p < n_pieces; p++) {
        const int64_t u = unit[p], r = lowest[p];
        if (u < 0 || u >= n_units || r < 0 || r >= n_queries || tokens[p] < 0 || bits[p] < 0)
            return -1;
        if (kv_start[u] < 0 || kv_start[u] + tokens[p] > n_slots)
            return -1;
        keep[u] = 0;
        b_total += tokens[p];
        if (new_bin[p]) {
            if (bins)
                b_pairs += bit_length(b_bits >> b_base);
            bins++;
            b_bits = 0;
            b_base = block_pos(r, capacity, start_of_rank);
        }
        b_bits |= bits[p];
        run_max = new_bin[p] && r > run_max ? r : run_max;
        const int64_t shift = block_pos(run_max, capacity, start_of_rank);
        if (b_base < 0 || b_base > 63 || shift < 0 || shift > 63)
            return -1;
    }
    if (bins)
        b_pairs += bit_length(b_bits >> b_base);
    int64_t kept = 0, k_total = 0, k_pairs = 0;
    for (int64_t u = 0; u < n_units; u++)
        if (keep[u]) {
            kept++;
            k_total += kv_len[u];
            k_pairs += q_len[u];
        }
    sizes[0] = bins;
    sizes[1] = kept;
    sizes[2] = k_total;
    sizes[3] = b_total;
    sizes[4] = k_pairs;
    sizes[5] = b_pairs;
    return 0;
}

/* The n_slots input slots of the assembly, as fasttree.groups.ChainedSlots holds them: entries below
 * n_head are head's; entry n_head + t (0 <= t < n_slots - n_head) is head[run_src[j] + t - run_off[j]]
 * for the run j with run_off[j] <= t < run_off[j + 1] (the chained groups' slots are runs of the
 * tree's). valid_runs checks that the runs cover exactly the entries past n_head and read inside
 * head; copy_entries then copies dst[0 .. n) = entries s .. s + n (0 <= s, s + n <= n_slots: the
 * caller checked), a run across the parts or the runs included. */
static int valid_runs(int64_t n_slots, int64_t n_head, int64_t n_runs, const int64_t *run_src,
                      const int64_t *run_off) {
    if (n_head < 0 || n_head > n_slots || n_runs < 0)
        return 0;
    if (n_head == n_slots)
        return 1;
    if (n_runs < 1 || run_off[0] != 0 || run_off[n_runs] != n_slots - n_head)
        return 0;
    for (int64_t j = 0; j < n_runs; j++) {
        const int64_t len = run_off[j + 1] - run_off[j];
        if (len < 0 || run_src[j] < 0 || run_src[j] > n_head - len)
            return 0;
    }
    return 1;
}

static inline void copy_entries(int32_t *dst, int64_t s, int64_t n, const int32_t *head, int64_t n_head,
                                int64_t n_runs, const int64_t *run_src, const int64_t *run_off) {
    int64_t k = 0;
    if (s < n_head) {
        const int64_t m = n_head - s < n ? n_head - s : n;
        const int32_t *src = head + s;
        for (; k < m; k++) dst[k] = src[k];
        if (k == n)
            return;
    }
    int64_t t = s + k - n_head, lo = 0, hi = n_runs; /* run_off[lo] <= t < run_off[hi] */
    while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (run_off[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    for (int64_t j = lo; k < n; j++) {
        const int64_t left = run_off[j + 1] - t, m = left < n - k ? left : n - k;
        const int32_t *src = head + run_src[j] + (t - run_off[j]);
        int32_t *out = dst + k;
        for (int64_t i = 0; i < m; i++) out[i] = src[i];
        k += m;
        t += m;
    }
}

/* Second pass (after ft_assemble_sizes succeeded on the same pieces): the packed units' arrays.
 * The n_slots input slots are kv_slots (n_head entries) and the runs of it past them, as
 * copy_entries reads them (n_head == n_slots: kv_slots alone, no runs). copy_kept: the slots are
 * the kept units' runs then the pieces' (else all n_slots input slots then the pieces'); n_old: the
 * entries before the pieces'. Returns 0, or -1 when a kept unit's KV run or pairs or a bin's ranks
 * are out of range, or the runs are not valid_runs. */
int64_t ft_assemble_fill(int64_t n_units, const int64_t *kv_start, const int64_t *kv_len,
                         const int64_t *pair_start, const int64_t *q_len, int64_t n_pairs, const int64_t *pair_query,
                         int64_t n_slots, const int32_t *kv_slots, int64_t n_head, int64_t n_runs,
                         const int64_t *run_src, const int64_t *run_off, int64_t n_queries, const int64_t *query_of_rank, int64_t capacity,
                         const int64_t *start_of_rank, int64_t n_pieces, const int64_t *unit,
                         const int64_t *lowest, const int64_t *bits, const int8_t *new_bin, const int64_t *tokens,
                         const int8_t *keep, int64_t copy_kept, int64_t n_old, int64_t *o_kv_start, int64_t *o_kv_len,
                         int64_t *o_pair_start, int64_t *o_q_len, int64_t *o_pair_query, int8_t *o_present,
                         int32_t *o_slots, int32_t *o_mask, int8_t *o_is_bin) {
    int64_t k = 0, e = 0, pr = 0;
    if (!valid_runs(n_slots, n_head, n_runs, run_src, run_off))
        return -1;
    /* units left alone: their KV (copied, or where they were), their pairs */
    for (int64_t u = 0; u < n_units; u++) {
        if (!keep[u])
            continue;
        const int64_t s = kv_start[u], n = kv_len[u], ps = pair_start[u], nq = q_len[u];
        if (s < 0 || n < 0 || s + n > n_slots || ps < 0 || nq < 0 || ps + nq > n_pairs)
            return -1;
        o_kv_len[k] = n;
        o_q_len[k] = nq;
        o_is_bin[k] = 0;
        if (copy_kept) {
            o_kv_start[k] = e;
            if (s + n <= n_head)
                for (int64_t i = 0; i < n; i++) o_slots[e + i] = kv_slots[s + i];
            else
                copy_entries(o_slots + e, s, n, kv_slots, n_head, n_runs, run_src, run_off);
            e += n;
        } else {
            o_kv_start[k] = s;
        }
        for (int64_t i = 0; i < nq; i++) {
            o_pair_query[pr + i] = pair_query[ps + i];
            o_present[pr + i] = 1;
        }
        pr += nq;
        k++;
    }
    if (!copy_kept) {
        copy_entries(o_slots, 0, n_slots, kv_slots, n_head, n_runs, run_src, run_off);
        e = n_slots;
    }
    for (int64_t i = 0; i < n_old; i++) o_mask[i] = -1;
    /* the bins: their pieces' slots and masks, then their rows */
    int64_t b = k - 1, run_max = 0, b_bits = 0, b_base = 0, b_rank = 0, b_tokens = 0;
    for (int64_t p = 0; p <= n_pieces; p++) {
        if (p == n_pieces || new_bin[p]) {
            if (b >= k) { /* close bin b: its entries and its rows */
                const int64_t shifted = b_bits >> b_base, rows = bit_length(shifted);
                if (b_rank + rows > n_queries)
                    return -1;
                o_kv_len[b] = b_tokens;
                o_q_len[b] = rows;
                o_is_bin[b] = 1;
                for (int64_t i = 0; i < rows; i++) {
                    o_pair_query[pr + i] = query_of_rank[b_rank + i];
                    o_present[pr + i] = (int8_t)((shifted >> i) & 1);
                }
                pr += rows;
            }
            if (p == n_pieces)
                break;
            b++;
            b_bits = 0;
            b_tokens = 0;
            b_rank = lowest[p];
            b_base = block_pos(b_rank, capacity, start_of_rank);
            o_kv_start[b] = e;
        }
        const int64_t r = lowest[p];
        run_max = new_bin[p] && r > run_max ? r : run_max;
        const int64_t shift = block_pos(run_max, capacity, start_of_rank);
        const int32_t m = (int32_t)(uint32_t)(bits[p] >> shift);
        const int64_t s = kv_start[unit[p]], n = tokens[p];
        if (s + n <= n_head) { /* the common case in one loop (the head's slots, then the mask) */
            const int32_t *src = kv_slots + s;
            for (int64_t i = 0; i < n; i++) {
                o_slots[e + i] = src[i];
                o_mask[e + i] = m;
            }
        } else {
            copy_entries(o_slots + e, s, n, kv_slots, n_head, n_runs, run_src, run_off);
            for (int64_t i = 0; i < n; i++) o_mask[e + i] = m;
        }
        e += n;
        b_bits |= bits[p];
        b_tokens += n;
    }
    int64_t acc = 0;
    for (int64_t u = 0; u <= b; u++) {
        o_pair_start[u] = acc;
        acc += o_q_len[u];
    }
    return 0;
}

/* What fasttree.plan_arrays._wide_cost compares for a bin layout (fasttree.packing.
 * layout_reads_and_served, then the partial rows of the served queries): out[0] = the KV tokens
 * read (the units no piece took, then every piece), out[1] = the partial rows (the served pairs
 * of every query with two or more). The units' pairs are in unit order (pair_query); a bin's
 * served ranks are its block's start (lowest rank rounded down to capacity, or start_of_rank of
 * it) plus each set bit of its pieces' OR. keep (n_units) and n_part (n_queries) are scratch.
 * Returns 0, or -1 when an index is out of range. */
int64_t ft_layout_cost(int64_t n_units, const int64_t *kv_len, const int64_t *q_len, int64_t n_pairs,
                       const int64_t *pair_query, int64_t n_pieces, const int64_t *unit, const int64_t *lowest,
                       const int64_t *bits, const int8_t *new_bin, const int64_t *tokens, int64_t n_queries,
                       const int64_t *query_of_rank, int64_t capacity, const int64_t *start_of_rank, int8_t *keep,
                       int64_t *n_part, int64_t *out) {
    int64_t reads = 0;
    if (capacity < 1 || capacity > 63 || (n_pieces && !new_bin[0]))
        return -1;
    for (int64_t u = 0; u < n_units; u++) keep[u] = 1;
    for (int64_t q = 0; q < n_queries; q++) n_part[q] = 0;
    for (int64_t p = 0; p < n_pieces; p++) {
        if (unit[p] < 0 || unit[p] >= n_units)
            return -1;
        keep[unit[p]] = 0;
        reads += tokens[p];
    }
    int64_t pr = 0;
    for (int64_t u = 0; u < n_units; u++) {
        if (q_len[u] < 0 || pr + q_len[u] > n_pairs)
            return -1;
        if (keep[u]) {
            reads += kv_len[u];
            for (int64_t i = 0; i < q_len[u]; i++) {
                const int64_t q = pair_query[pr + i];
                if (q < 0 || q >= n_queries)
                    return -1;
                n_part[q]++;
            }
        }
        pr += q_len[u];
    }
    for (int64_t p = 0; p < n_pieces;) {
        const int64_t r = lowest[p];
        if (r < 0 || r >= n_queries)
            return -1;
        const int64_t start = r - block_pos(r, capacity, start_of_rank);
        int64_t b_bits = 0;
        do {
            b_bits |= bits[p];
            p++;
        } while (p < n_pieces && !new_bin[p]);
        for (int64_t i = 0; i < capacity; i++) {
            if (!((b_bits >> i) & 1))
                continue;
            if (start + i < 0 || start + i >= n_queries)
                return -1;
            const int64_t q = query_of_rank[start + i];
            if (q < 0 || q >= n_queries)
                return -1;
            n_part[q]++;
        }
    }
    int64_t rows = 0;
    for (int64_t q = 0; q < n_queries; q++)
        if (n_part[q] >= 2)
            rows += n_part[q];
    out[0] = reads;
    out[1] = rows;
    return 0;
}

/* fasttree.packing._aligned_blocks over the candidates (units 0..n_cand-1 of c_len pairs each,
 * c_rank their pairs' ranks, units back to back): blocks of at most capacity consecutive ranks
 * ending where no short unit continues. Writes block_of_rank and start_of_rank (n_queries each)
 * and returns 1, or 0 when the blocks are the fixed ones. scratch: int64 [2 * n + 3]. */
static int64_t aligned_blocks(int64_t n_cand, const int64_t *c_len, const int64_t *c_rank, int64_t n,
                              int64_t capacity, int64_t *block_of_rank, int64_t *start_of_rank, int64_t *scratch) {
    int64_t *inside = scratch, *nxt = scratch + n + 2;
    memset(inside, 0, sizeof(int64_t) * (size_t)(n + 2));
    int64_t any = 0, first = 0;
    for (int64_t j = 0; j < n_cand; j++) {
        int64_t lo = c_rank[first], hi = c_rank[first];
        for (int64_t i = first + 1; i < first + c_len[j]; i++) {
            if (c_rank[i] < lo) lo = c_rank[i];
            if (c_rank[i] > hi) hi = c_rank[i];
        }
        first += c_len[j];
        if (hi - lo < capacity && hi > lo) {
            inside[lo + 1]++;
            inside[hi + 1]--;
            if (lo / capacity != hi / capacity) any = 1;
        }
    }
    int64_t result = 0;
    if (any) {
        /* free boundaries (nothing split there): prefix sum zero; 0 and n always are */
        int64_t run = 0, last_free = 0;
        for (int64_t c = 0; c <= n; c++) {
            run += inside[c];
            inside[c] = run == 0; /* reused: free[c] */
        }
        /* far[s]: the last free boundary <= min(s + capacity, n); walk the starts */
        int64_t f = 0;
        for (int64_t s = 0; s <= n; s++) {
            const int64_t reach = s + capacity < n ? s + capacity : n;
            while (f <= reach) {
                if (inside[f]) last_free = f;
                f++;
            }
            nxt[s] = last_free > s ? last_free : reach;
        }
        int64_t n_blocks = 0, fixed = 1;
        for (int64_t s = 0, b = -1; s < n;) {
            b++;
            n_blocks++;
            if (s % capacity) fixed = 0;
            for (int64_t r = s; r < nxt[s]; r++) {
                block_of_rank[r] = b;
                start_of_rank[r] = s;
            }
            s = nxt[s];
        }
        result = !(fixed && n_blocks == (n + capacity - 1) / capacity);
    }
    return result;
}

/* What the units read and their longest unit once bins are formed (count 0: the units as they
 * are): fasttree.packing._reads_and_longest. keep: n_units scratch. */
static void reads_and_longest(int64_t n_units, const int64_t *kv_len, int64_t count, const int64_t *unit,
                              const int8_t *new_run, const int64_t *tokens, int8_t *keep, int64_t *reads,
                              int64_t *longest) {
    int64_t r = 0, l = 0;
    for (int64_t u = 0; u < n_units; u++) keep[u] = 1;
    for (int64_t p = 0; p < count; p++) keep[unit[p]] = 0;
    for (int64_t u = 0; u < n_units; u++)
        if (keep[u]) {
            r += kv_len[u];
            if (kv_len[u] > l) l = kv_len[u];
        }
    int64_t b = 0;
    for (int64_t p = 0; p < count; p++) {
        if (new_run[p] && p) {
            if (b > l) l = b;
            b = 0;
        }
        b += tokens[p];
        r += tokens[p];
    }
    if (count && b > l) l = b;
    *reads = r;
    *longest = l;
}

/* fasttree.packing.bin_layout for units whose pairs are in unit order: the eligible units' pairs
 * (ranks through query_rank) binned in fixed blocks and, where that cut a unit and aligned is not
 * 0, in aligned blocks, taken when aligned is 1 or (2) when they read no more and their longest
 * unit is at most max_longer times the fixed one's. Writes the chosen bins' members into
 * out_f / new_f (fixed) or out_a / new_a (aligned; start_of_rank then holds the blocks' starts;
 * out_f and out_a are [4][n_pairs]: unit, lowest rank, bits, tokens), res[0] = members (0: no
 * bin) and res[1] = 1 when the aligned blocks were taken. work (int64): c_unit, c_rank, c_len
 * [n_pairs each], block_of_rank, start_of_rank [n_queries each], out_f, out_a [4 * n_pairs each],
 * res [2], then the scratch of ft_bin_members (BIN_MEMBERS_SCRATCH(n_pairs, n_units, n_queries),
 * which also holds aligned_blocks' 2 * n_queries + 3); work8 (int8): new_f, new_a [n_pairs each],
 * keep [n_units]. Returns 0, or -2 an index out of range or a unit without pairs (the caller runs
 * numpy). */
int64_t ft_bin_layout(int64_t n_units, const int64_t *q_len, const int64_t *kv_len, int64_t n_pairs,
                      const int64_t *pair_query, const int8_t *eligible, int64_t n_queries, const int64_t *query_rank,
                      int64_t capacity, int64_t budget, int64_t balanced, int64_t aligned, double max_longer,
                      int64_t *work, int8_t *work8) {
    int64_t *c_unit = work, *c_rank = work + n_pairs, *c_len = work + 2 * n_pairs;
    int64_t *block_of_rank = work + 3 * n_pairs, *start_of_rank = block_of_rank + n_queries;
    int64_t *out_f = start_of_rank + n_queries, *out_a = out_f + 4 * n_pairs, *res = out_a + 4 * n_pairs;
    int64_t *scratch = res + 2;
    int8_t *new_f = work8, *new_a = work8 + n_pairs, *keep = work8 + 2 * n_pairs;
    int64_t n_c = 0, n_cand = 0, pr = 0;
    res[0] = res[1] = 0;
    for (int64_t u = 0; u < n_units; u++) {
        if (q_len[u] < 0 || pr + q_len[u] > n_pairs)
            return -2;
        if (eligible[u]) {
            if (q_len[u] < 1)
                return -2;
            c_len[n_cand++] = q_len[u];
            for (int64_t i = pr; i < pr + q_len[u]; i++) {
                const int64_t q = pair_query[i];
                if (q < 0 || q >= n_queries || query_rank[q] < 0 || query_rank[q] >= n_queries)
                    return -2;
                c_unit[n_c] = u;
                c_rank[n_c++] = query_rank[q];
            }
        }
        pr += q_len[u];
    }
    if (n_cand < 2)
        return 0;
    int64_t cut = 0;
    const int64_t nf = ft_bin_members(n_c, c_unit, c_rank, n_queries, n_units, capacity, NULL, NULL, kv_len, budget,
                                      balanced, out_f, out_f + n_pairs, out_f + 2 * n_pairs, new_f, out_f + 3 * n_pairs,
                                      &cut, scratch);
    res[0] = nf;
    if (!aligned || !cut)
        return 0;
    const int64_t shifted =
        aligned_blocks(n_cand, c_len, c_rank, n_queries, capacity, block_of_rank, start_of_rank, scratch);
    if (!shifted)
        return 0;
    int64_t cut_a = 0;
    const int64_t na = ft_bin_members(n_c, c_unit, c_rank, n_queries, n_units, capacity, block_of_rank, start_of_rank,
                                      kv_len, budget, balanced, out_a, out_a + n_pairs, out_a + 2 * n_pairs, new_a,
                                      out_a + 3 * n_pairs, &cut_a, scratch);
    int take = aligned == 1;
    if (!take) {
        int64_t reads_f, longest_f, reads_a, longest_a;
        reads_and_longest(n_units, kv_len, nf, out_f, new_f, out_f + 3 * n_pairs, keep, &reads_f, &longest_f);
        reads_and_longest(n_units, kv_len, na, out_a, new_a, out_a + 3 * n_pairs, keep, &reads_a, &longest_a);
        take = reads_a <= reads_f && (double)longest_a <= max_longer * (double)longest_f;
    }
    if (take) {
        res[0] = na;
        res[1] = 1;
    }
    return 0;
}

/* The stable order of n keys (non-negative, below 2**(8 * passes)) by an LSD radix sort of bytes:
 * order and tmp [n] (the result in order). */
static void radix_order(int64_t n, const int64_t *key, int passes, int64_t *order, int64_t *tmp) {
    int64_t count[257];
    for (int64_t i = 0; i < n; i++) order[i] = i;
    for (int pass = 0; pass < passes; pass++) {
        const int shift = 8 * pass;
        for (int b = 0; b <= 256; b++) count[b] = 0;
        for (int64_t i = 0; i < n; i++) count[((key[i] >> shift) & 255) + 1]++;
        int one_bucket = 0;
        for (int b = 1; b <= 256; b++) one_bucket |= count[b] == n;
        if (one_bucket) continue; /* every key has this byte: the order stays */
        for (int b = 0; b < 256; b++) count[b + 1] += count[b];
        for (int64_t i = 0; i < n; i++) {
            const int64_t u = order[i];
            tmp[count[(key[u] >> shift) & 255]++] = u;
        }
        for (int64_t i = 0; i < n; i++) order[i] = tmp[i];
    }
}

/* A plan's unit, pair and partial-row arrays (fasttree.plan_arrays._unit_arrays_native). The
 * units' tile classes and order (fasttree.plan_arrays.materialize and _class_order): unit u is in
 * the small class when q_len[u] <= small_kept (u < n_kept: a unit left alone) or <= small_bin (a
 * bin); the order is the large class first, within a class the longest KV first, stable. The
 * units in that order (int32 copies of kv_start, kv_len, pair_start, q_len), the pairs' queries
 * (int32, pair order), and the partial rows of fasttree.plan_arrays._partial_rows: n_part[q] the
 * present pairs of query q (pair_present NULL: every pair), part_start the exclusive sum over the
 * queries of n_part where it is >= 2, a present pair's row part_start[q] plus its rank among q's
 * present pairs in pair order (-1 for a query with one pair), -2 (ABSENT_ROW) for a pair that
 * serves no query, merge the queries with two or more in increasing order. seen: int64
 * [n_queries] scratch; work: int64 [3 * n_units] scratch. counts[0] = partial rows, counts[1] =
 * merge queries, counts[2] = units in the large class, counts[3] = bins in the small class.
 * Returns 0; -1 when a KV length is negative or 2**31 or more, or a pair's query is out of range
 * (nothing is trusted); -2 when a query has no present pair. */
int64_t ft_unit_arrays(int64_t n_units, int64_t n_kept, int64_t small_kept, int64_t small_bin, const int64_t *kv_start,
                       const int64_t *kv_len, const int64_t *pair_start, const int64_t *q_len, int64_t n_pairs,
                       const int64_t *pair_query, const int8_t *pair_present, int64_t n_queries, int32_t *o_kv_start,
                       int32_t *o_kv_len, int32_t *o_q_start, int32_t *o_q_len, int32_t *o_pair_query,
                       int32_t *o_out_row, int32_t *o_part_start, int32_t *o_n_part, int32_t *o_merge, int64_t *seen,
                       int64_t *work, int64_t *counts) {
    int64_t *key = work, *order = work + n_units, *tmp = work + 2 * n_units;
    int64_t longest = 0, n_large = 0, small_bins = 0;
    for (int64_t u = 0; u < n_units; u++) {
        if (kv_len[u] < 0 || kv_len[u] > 0x7FFFFFFF)
            return -1;
        if (kv_len[u] > longest) longest = kv_len[u];
    }
    /* the key: the class bit above the complement of the KV length (16 bits when they fit, as
     * numpy's radix sort of _class_order; else 32) */
    const int bits = longest < (1 << 15) ? 15 : 31;
    const int64_t top = ((int64_t)1 << bits) - 1;
    for (int64_t u = 0; u < n_units; u++) {
        const int small = q_len[u] <= (u < n_kept ? small_kept : small_bin);
        key[u] = ((int64_t)small << bits) | (top - kv_len[u]);
        n_large += !small;
        small_bins += small && u >= n_kept;
    }
    radix_order(n_units, key, bits == 15 ? 2 : 4, order, tmp);
    for (int64_t i = 0; i < n_units; i++) {
        const int64_t u = order[i];
        o_kv_start[i] = (int32_t)kv_start[u];
        o_kv_len[i] = (int32_t)kv_len[u];
        o_q_start[i] = (int32_t)pair_start[u];
        o_q_len[i] = (int32_t)q_len[u];
    }
    counts[2] = n_large;
    counts[3] = small_bins;
    for (int64_t q = 0; q < n_queries; q++) seen[q] = 0;
    for (int64_t p = 0; p < n_pairs; p++) {
        const int64_t q = pair_query[p];
        if (q < 0 || q >= n_queries)
            return -1;
        o_pair_query[p] = (int32_t)q;
        if (!pair_present || pair_present[p])
            seen[q]++;
    }
    int64_t rows = 0, n_merge = 0;
    for (int64_t q = 0; q < n_queries; q++) {
        const int64_t n = seen[q];
        if (n < 1)
            return -2;
        o_n_part[q] = (int32_t)n;
        o_part_start[q] = (int32_t)rows;
        if (n >= 2) {
            o_merge[n_merge++] = (int32_t)q;
            seen[q] = rows; /* the next row of q */
            rows += n;
        } else {
            seen[q] = -1;
        }
    }
    for (int64_t p = 0; p < n_pairs; p++) {
        if (pair_present && !pair_present[p]) {
            o_out_row[p] = -2;
            continue;
        }
        const int64_t q = pair_query[p];
        o_out_row[p] = seen[q] < 0 ? -1 : (int32_t)seen[q]++;
    }
    counts[0] = rows;
    counts[1] = n_merge;
    return 0;
}

/* Bounds of ft_packed_plan's arrays for n_units units of n_pairs pairs and n_pieces pieces in bins of
 * capacity queries (fasttree.plan_arrays._packed_plan_sizes computes the same): the packed units
 * (the kept ones, then the bins) are at most PACKED_UNITS, their pairs at most PACKED_PAIRS (a bin
 * has at most capacity rows); its int64 work memory is PACKED_PLAN_WORK entries (the assembly's 6
 * sizes and the unit arrays' 4 counts, the packed units' kv_start, kv_len, pair_start, q_len
 * [PACKED_UNITS each] and pair_query [PACKED_PAIRS], per query scratch [n_queries], the unit order's
 * [3 * PACKED_UNITS], then int8 keep [n_units], pair_present [PACKED_PAIRS] and is_bin [PACKED_UNITS]
 * in whole int64 entries); its int32 output is PACKED_PLAN_OUT entries. */
#define PACKED_UNITS(n_units, n_pieces) ((n_units) + (n_pieces))
#define PACKED_PAIRS(n_pairs, n_pieces, capacity) ((n_pairs) + (capacity) * (n_pieces))
#define PACKED_PLAN_WORK(n_units, n_pairs, n_pieces, capacity, n_queries)                                           \
    (10 + 7 * PACKED_UNITS(n_units, n_pieces) + PACKED_PAIRS(n_pairs, n_pieces, capacity) + (n_queries) +          \
     ((n_units) + PACKED_PAIRS(n_pairs, n_pieces, capacity) + PACKED_UNITS(n_units, n_pieces) + 7) / 8)
#define PACKED_PLAN_OUT(n_units, n_pairs, n_pieces, capacity, n_queries)                                            \
    (4 * PACKED_UNITS(n_units, n_pieces) + 2 * PACKED_PAIRS(n_pairs, n_pieces, capacity) + 3 * (n_queries))

/* A packed plan's arrays in one call (fasttree.plan_arrays._packed_plan_native): the packed units of
 * a bin layout (ft_assemble_sizes, then ft_assemble_fill) and their int32 unit, pair and partial-row
 * arrays (ft_unit_arrays, small_kept / small_bin its small-class limits). The n_slots input slots
 * are kv_slots' n_head entries and n_runs runs of them, as ft_assemble_fill reads them. o_slots and
 * o_mask hold n_slots + b_total entries (b_total: the pieces' tokens; the packed entries are the kept
 * units' or all n_slots input slots, then the pieces'). out (int32 [PACKED_PLAN_OUT]) receives, back to
 * back, kv_start, kv_len, q_start, q_len [n_out units each], pair_query, out_row [n_out_pairs each],
 * part_start, n_part [n_queries each] and merge [n_merge]. work (int64 [PACKED_PLAN_WORK]) starts
 * with ft_assemble_sizes' sizes (bins, kept units, kept entries, bin entries, kept pairs, bin
 * pairs), then ft_unit_arrays' counts (partial rows, merge queries, large-class units, small-class
 * bins). Returns 0; -1 when a piece, KV run, rank or pair is out of range, the pieces' tokens are not
 * b_total or the packed units exceed the bounds (nothing is written past them); ft_unit_arrays'
 * -1 or -2 otherwise. */
int64_t ft_packed_plan(int64_t n_units, const int64_t *kv_start, const int64_t *kv_len, const int64_t *pair_start,
                       const int64_t *q_len, int64_t n_pairs, const int64_t *pair_query, int64_t n_slots,
                       const int32_t *kv_slots, int64_t n_head, int64_t n_runs, const int64_t *run_src,
                       const int64_t *run_off, int64_t n_queries,
                       const int64_t *query_of_rank, int64_t capacity, const int64_t *start_of_rank,
                       int64_t n_pieces, const int64_t *unit, const int64_t *lowest,
                       const int64_t *bits, const int8_t *new_bin, const int64_t *tokens, int64_t b_total,
                       int64_t small_kept, int64_t small_bin, int32_t *o_slots, int32_t *o_mask, int32_t *out,
                       int64_t *work) {
    if (capacity < 1 || n_units < 0 || n_pairs < 0 || n_pieces < 0 || n_queries < 0)
        return -1;
    const int64_t max_units = PACKED_UNITS(n_units, n_pieces), max_pairs = PACKED_PAIRS(n_pairs, n_pieces, capacity);
    int64_t *sizes = work, *counts = work + 6;
    int64_t *u_kv_start = work + 10, *u_kv_len = u_kv_start + max_units, *u_pair_start = u_kv_len + max_units;
    int64_t *u_q_len = u_pair_start + max_units, *u_pair_query = u_q_len + max_units;
    int64_t *seen = u_pair_query + max_pairs, *order = seen + n_queries;
    int8_t *keep = (int8_t *)(order + 3 * max_units), *present = keep + n_units, *is_bin = present + max_pairs;
    if (ft_assemble_sizes(n_units, kv_start, kv_len, q_len, n_slots, n_queries, capacity, start_of_rank, n_pieces,
                          unit, lowest, bits, new_bin, tokens, keep, sizes))
        return -1;
    const int64_t n_bins = sizes[0], n_kept = sizes[1], k_total = sizes[2], k_pairs = sizes[4], b_pairs = sizes[5];
    const int64_t n_out = n_kept + n_bins, n_out_pairs = k_pairs + b_pairs;
    if (sizes[3] != b_total || n_out > max_units || n_out_pairs > max_pairs)
        return -1;
    const int64_t copy_kept = 2 * k_total < n_slots, n_old = copy_kept ? k_total : n_slots;
    if (ft_assemble_fill(n_units, kv_start, kv_len, pair_start, q_len, n_pairs, pair_query, n_slots, kv_slots,
                         n_head, n_runs, run_src, run_off, n_queries, query_of_rank, capacity, start_of_rank, n_pieces, unit, lowest, bits, new_bin,
                         tokens, keep, copy_kept, n_old, u_kv_start, u_kv_len, u_pair_start, u_q_len, u_pair_query,
                         present, o_slots, o_mask, is_bin))
        return -1;
    int32_t *o_pairs = out + 4 * n_out, *o_queries = o_pairs + 2 * n_out_pairs;
    return ft_unit_arrays(n_out, n_kept, small_kept, small_bin, u_kv_start, u_kv_len, u_pair_start, u_q_len,
                          n_out_pairs, u_pair_query, present, n_queries, out, out + n_out, out + 2 * n_out,
                          out + 3 * n_out, o_pairs, o_pairs + n_out_pairs, o_queries, o_queries + n_queries,
                          o_queries + 2 * n_queries, seen, order, counts);
}

/* The work units of fasttree.plan_arrays._cut_units: group g's queries (q_indptr[g] ..
 * q_indptr[g + 1], at least one) cut into tiles of tile_q and its KV (kv_len[g] >= 1 tokens from
 * kv_start[g]) into chunks of its split (split_g[g], or split when split_g is NULL), units in group
 * order, a group's chunks outermost. Called first with the outputs NULL: counts[0] = units,
 * counts[1] = pairs. Then with them: each unit's KV start and length, its first pair and query
 * count, and the pairs' queries (q_ids of its tile). Returns 0, or -1 when a group has no token or
 * query, a split or tile_q is < 1, or q_indptr runs outside the n_ids query ids. */
int64_t ft_cut_units(int64_t n_groups, const int64_t *kv_start, const int64_t *kv_len, const int64_t *q_indptr,
                     const int64_t *q_ids, int64_t n_ids, int64_t tile_q, int64_t split, const int64_t *split_g,
                     int64_t *counts, int64_t *o_kv_start, int64_t *o_kv_len, int64_t *o_pair_start, int64_t *o_q_len,
                     int64_t *o_pair_query) {
    if (tile_q < 1 || (n_groups && (q_indptr[0] < 0 || q_indptr[n_groups] > n_ids)))
        return -1;
    int64_t units = 0, pairs = 0;
    for (int64_t g = 0; g < n_groups; g++) {
        const int64_t s = split_g ? split_g[g] : split, len = kv_len[g], nq = q_indptr[g + 1] - q_indptr[g];
        if (s < 1 || len < 1 || nq < 1)
            return -1;
        /* (a 64-bit division costs tens of cycles: many groups are one chunk or one tile) */
        const int64_t chunks = len <= s ? 1 : (len + s - 1) / s, tiles = nq <= tile_q ? 1 : (nq + tile_q - 1) / tile_q;
        if (!o_kv_start) {
            units += chunks * tiles;
            pairs += chunks * nq;
            continue;
        }
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t start = kv_start[g] + c * s, rest = len - c * s;
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t first = q_indptr[g] + t * tile_q, left = nq - t * tile_q;
                const int64_t n = left < tile_q ? left : tile_q;
                o_kv_start[units] = start;
                o_kv_len[units] = rest < s ? rest : s;
                o_pair_start[units] = pairs;
                o_q_len[units] = n;
                for (int64_t i = 0; i < n; i++) o_pair_query[pairs + i] = q_ids[first + i];
                units++;
                pairs += n;
            }
        }
    }
    counts[0] = units;
    counts[1] = pairs;
    return 0;
}

/* A forest's levels (fasttree.tree.KVTree._init): with parents in [-1, n) and no self loops (the
 * caller checked), each node's depth (unless depth_known: then depth holds them), level_order (the
 * nodes by depth, then id), level_ptr [max depth + 2] (where each depth starts in level_order),
 * path_lengths (tokens from the root to the node, inclusive) and subtree_queries (the queries at
 * or below the node). state: int8 [n] scratch. Returns the largest depth, or -1 on a cycle (then
 * the caller's numpy path names it). */
int64_t ft_tree_levels(int64_t n, const int64_t *parents, const int64_t *lengths, int64_t n_queries,
                       const int64_t *query_nodes, int64_t depth_known, int64_t *depth, int64_t *level_order,
                       int64_t *level_ptr, int64_t *path_lengths, int64_t *subtree_queries, int8_t *state) {
    if (!depth_known) {
        /* walk up from each node to a root or a node whose depth is known, the walk's nodes on a
         * stack (level_order as scratch); a node met twice on one walk closes a cycle */
        for (int64_t v = 0; v < n; v++) state[v] = 0; /* 0 new, 1 on the current walk, 2 known */
        for (int64_t v0 = 0; v0 < n; v0++) {
            if (state[v0] == 2) continue;
            int64_t top = 0, v = v0, d;
            for (;;) {
                if (state[v] == 2) {
                    d = depth[v];
                    break;
                }
                if (state[v] == 1) return -1;
                state[v] = 1;
                level_order[top++] = v;
                if (parents[v] < 0) {
                    d = -1;
                    break;
                }
                v = parents[v];
            }
            while (top > 0) {
                const int64_t u = level_order[--top];
                depth[u] = ++d;
                state[u] = 2;
            }
        }
    }
    int64_t max_depth = 0;
    for (int64_t v = 0; v < n; v++) max_depth = depth[v] > max_depth ? depth[v] : max_depth;
    for (int64_t d = 0; d <= max_depth + 1; d++) level_ptr[d] = 0;
    for (int64_t v = 0; v < n; v++) level_ptr[depth[v] + 1]++;
    for (int64_t d = 0; d <= max_depth; d++) level_ptr[d + 1] += level_ptr[d];
    /* stable by depth: a node's place is its level's start plus the nodes of its depth before it */
    for (int64_t d = 0; d <= max_depth; d++) subtree_queries[d] = level_ptr[d]; /* scratch: next place per depth */
    for (int64_t v = 0; v < n; v++) level_order[subtree_queries[depth[v]]++] = v;
    for (int64_t v = 0; v < n; v++) subtree_queries[v] = 0;
    for (int64_t j = 0; j < n_queries; j++) subtree_queries[query_nodes[j]]++;
    for (int64_t i = 0; i < n; i++) {
        const int64_t v = level_order[i], p = parents[v];
        path_lengths[v] = lengths[v] + (p >= 0 ? path_lengths[p] : 0);
    }
    for (int64_t i = n - 1; i >= 0; i--) {
        const int64_t v = level_order[i], p = parents[v];
        if (p >= 0) subtree_queries[p] += subtree_queries[v];
    }
    return max_depth;
}

/* The queries' DFS positions (fasttree.planner._GroupIndex: a node's own queries in id order,
 * then its children's subtrees in edge order): roots[0..n_roots) in id order, the edges
 * (children ch, parents cp) by depth, parent, then id. Writes qlo [n] (the first position of each
 * node's subtree, whose subtree_queries sq follow), rank [n_queries] (each query's position) and
 * perm [n_queries] (the query at each position). own: int64 [n] scratch. Returns 1 when perm is
 * the identity, 0 otherwise, -1 when an id is out of range. */
int64_t ft_query_positions(int64_t n, const int64_t *sq, int64_t n_queries, const int64_t *query_nodes,
                           int64_t n_roots, const int64_t *roots, int64_t n_edges, const int64_t *ch,
                           const int64_t *cp, int64_t *qlo, int64_t *rank, int64_t *perm, int64_t *own) {
    for (int64_t v = 0; v < n; v++) own[v] = 0;
    for (int64_t j = 0; j < n_queries; j++) {
        if (query_nodes[j] < 0 || query_nodes[j] >= n) return -1;
        own[query_nodes[j]]++;
    }
    /* own becomes each node's next free position: after its own queries, then after each child */
    int64_t at = 0;
    for (int64_t i = 0; i < n_roots; i++) {
        const int64_t v = roots[i];
        if (v < 0 || v >= n) return -1;
        qlo[v] = at;
        own[v] += at;
        at += sq[v];
    }
    for (int64_t e = 0; e < n_edges; e++) {
        const int64_t c = ch[e], p = cp[e];
        if (c < 0 || c >= n || p < 0 || p >= n) return -1;
        qlo[c] = own[p];
        own[p] += sq[c];
        own[c] += qlo[c];
    }
    /* a query's position: its node's first plus the node's queries before it (in id order) */
    for (int64_t v = 0; v < n; v++) own[v] = qlo[v];
    int64_t identity = 1;
    for (int64_t j = 0; j < n_queries; j++) {
        const int64_t r = own[query_nodes[j]]++;
        if (r < 0 || r >= n_queries) return -1;
        rank[j] = r;
        perm[r] = j;
        identity &= r == j;
    }
    return identity;
}

/* Whether every node's first old_len[v] slots are the same in two trees (fasttree.plan_extend:
 * the old tokens keep their slots): new_slots[new_indptr[v] ...] against old_slots[old_indptr[v]
 * ...] for v < n. new_size / old_size: the slot arrays' lengths. Returns 1 when they all match,
 * 0 when one differs, -1 when a run lies outside its slot array. */
int64_t ft_prefixes_equal(int64_t n, const int32_t *new_slots, int64_t new_size, const int64_t *new_indptr,
                          const int32_t *old_slots, int64_t old_size, const int64_t *old_indptr,
                          const int64_t *old_len) {
    for (int64_t v = 0; v < n; v++) {
        const int64_t a = new_indptr[v], b = old_indptr[v], len = old_len[v];
        if (len < 0 || a < 0 || b < 0 || a + len > new_size || b + len > old_size) return -1;
        if (len && memcmp(new_slots + a, old_slots + b, (size_t)len * sizeof(int32_t)) != 0) return 0;
    }
    return 1;
}

/* Count of sorted[0..n) below x (numpy.searchsorted(sorted, x, side="left")). */
static int64_t ft_below(const int64_t *sorted, int64_t n, int64_t x) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (sorted[mid] < x) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* A plan's KV entries with new tokens inserted (fasttree.plan_extend.PlanExtender.extend): node k
 * of n_ins (anchor order: anchor strictly increasing) gets d[k] new entries right after entry
 * anchor[k], holding slots[first_new[k] ...] (slots: n_slots) and, with a row mask, the anchor's
 * mask. Writes kv_out (int32 [n_old + sum d]), mask_out (when mask is not NULL), the units' KV
 * starts shifted by the entries inserted before them and their lengths grown (unit_of[k]: the unit
 * of node k's anchor; int32 [n_units] each; -1 when a length passes int32), and new_anchor
 * [n_nodes]: every found anchor (anchor_all >= 0) shifted likewise, node k's (nodes[k]) moved to
 * its last new entry. Returns 0, or -1 on an index out of range. */
int64_t ft_extend_entries(int64_t n_old, const int32_t *kv, const int32_t *mask, int64_t n_ins, const int64_t *anchor,
                          const int64_t *d, const int64_t *first_new, const int64_t *nodes, const int64_t *unit_of,
                          int64_t n_slots, const int32_t *slots, int64_t n_units, const int32_t *unit_start,
                          const int32_t *unit_len, int64_t n_nodes, const int64_t *anchor_all, int32_t *kv_out,
                          int32_t *mask_out, int32_t *unit_start_out, int32_t *unit_len_out, int64_t *new_anchor,
                          int64_t *before) {
    /* before[k]: entries inserted by nodes 0..k-1 */
    int64_t total = 0;
    for (int64_t k = 0; k < n_ins; k++) {
        if (anchor[k] < 0 || anchor[k] >= n_old || (k && anchor[k] <= anchor[k - 1]) || d[k] < 0 ||
            first_new[k] < 0 || first_new[k] + d[k] > n_slots || nodes[k] < 0 || nodes[k] >= n_nodes ||
            unit_of[k] < 0 || unit_of[k] >= n_units)
            return -1;
        before[k] = total;
        total += d[k];
    }
    before[n_ins] = total;
    int64_t src = 0, dst = 0;
    for (int64_t k = 0; k < n_ins; k++) {
        const int64_t upto = anchor[k] + 1, run = upto - src, dk = d[k];
        memcpy(kv_out + dst, kv + src, (size_t)run * sizeof(int32_t));
        memcpy(kv_out + dst + run, slots + first_new[k], (size_t)dk * sizeof(int32_t));
        if (mask) {
            memcpy(mask_out + dst, mask + src, (size_t)run * sizeof(int32_t));
            const int32_t m = mask[anchor[k]];
            for (int64_t j = 0; j < dk; j++) mask_out[dst + run + j] = m;
        }
        dst += run + dk;
        src = upto;
    }
    memcpy(kv_out + dst, kv + src, (size_t)(n_old - src) * sizeof(int32_t));
    if (mask) memcpy(mask_out + dst, mask + src, (size_t)(n_old - src) * sizeof(int32_t));
    for (int64_t u = 0; u < n_units; u++) {
        unit_start_out[u] = (int32_t)(unit_start[u] + before[ft_below(anchor, n_ins, unit_start[u])]);
        unit_len_out[u] = unit_len[u];
    }
    for (int64_t k = 0; k < n_ins; k++) {
        const int64_t len = (int64_t)unit_len_out[unit_of[k]] + d[k];
        if (len > 0x7FFFFFFF) return -1;
        unit_len_out[unit_of[k]] = (int32_t)len;
    }
    for (int64_t v = 0; v < n_nodes; v++) {
        const int64_t a = anchor_all[v];
        new_anchor[v] = a >= 0 ? a + before[ft_below(anchor, n_ins, a)] : a;
    }
    for (int64_t k = 0; k < n_ins; k++) new_anchor[nodes[k]] += d[k];
    return 0;
}

/* The anchors of a plan's private nodes (fasttree.plan_extend.PlanExtender._find_anchors):
 * candidate j of n_cand (node cand[j] < n_nodes, whose last token is in slot last[j]) is anchored
 * at entry e when e lies in a unit's range [unit_start[u], unit_start[u] + unit_len[u]), kv[e] ==
 * last[j], no other entry in a unit's range holds that slot, no other candidate ends in it, and the
 * entry serves one row: a mask (when not NULL) with one bit set, or all ones (or no mask) on a
 * one-query unit (unit_q_len[u] == 1). Writes anchor[cand[j]] = e and anchor_unit[cand[j]] = u
 * for each anchored candidate (others untouched). table: int32 [table_size] scratch, -1 everywhere
 * on entry and on return, table_size > every last[j]; scratch: int64 [4 * n_cand]. Returns 0, or
 * -1 on an index out of range (the table is then restored too). */
int64_t ft_find_anchors(int64_t n_cand, const int64_t *cand, const int64_t *last, int64_t n_kv, const int32_t *kv,
                        const int32_t *mask, int64_t n_units, const int32_t *unit_start, const int32_t *unit_len,
                        const int32_t *unit_q_len, int64_t table_size, int32_t *table, int64_t n_nodes,
                        int64_t *scratch, int64_t *anchor, int64_t *anchor_unit) {
    int64_t *sharing = scratch, *hits = scratch + n_cand, *at = scratch + 2 * n_cand, *at_unit = scratch + 3 * n_cand;
    for (int64_t j = 0; j < n_cand; j++) {
        if (last[j] < 0 || last[j] >= table_size || cand[j] < 0 || cand[j] >= n_nodes) return -1;
        sharing[j] = hits[j] = 0;
    }
    for (int64_t j = 0; j < n_cand; j++) table[last[j]] = (int32_t)j;
    for (int64_t j = 0; j < n_cand; j++) sharing[table[last[j]]]++; /* candidates ending in the slot j won */
    int64_t rc = 0;
    for (int64_t u = 0; u < n_units && rc == 0; u++) {
        const int64_t lo = unit_start[u], hi = lo + (int64_t)unit_len[u];
        if (lo < 0 || hi > n_kv) {
            rc = -1;
            break;
        }
        for (int64_t e = lo; e < hi; e++) {
            const int64_t s = kv[e];
            if (s < 0 || s >= table_size) continue; /* beyond every candidate's slot: no hit */
            const int32_t h = table[s];
            if (h >= 0) {
                hits[h]++;
                at[h] = e;
                at_unit[h] = u;
            }
        }
    }
    for (int64_t j = 0; j < n_cand; j++) table[last[j]] = -1;
    if (rc) return rc;
    for (int64_t j = 0; j < n_cand; j++) {
        if (sharing[j] != 1 || hits[j] != 1) continue; /* a shared last slot (or not this slot's winner), or not once */
        const int64_t e = at[j], u = at_unit[j];
        int64_t single;
        if (mask) {
            const uint32_t m = (uint32_t)mask[e];
            single = (m != 0 && (m & (m - 1)) == 0) || (m == 0xFFFFFFFFu && unit_q_len[u] == 1);
        } else {
            single = unit_q_len[u] == 1;
        }
        if (single) {
            anchor[cand[j]] = e;
            anchor_unit[cand[j]] = u;
        }
    }
    return 0;
}
