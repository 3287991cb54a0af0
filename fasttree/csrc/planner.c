/* Native cores of the host planner (fasttree.native loads this file with ctypes).
 *
 * Each function reproduces one numpy/Python path of fasttree.planner operation for operation
 * (the same float64 expressions in the same order), so a plan is bit-identical whichever path
 * made it; tests/test_native.py compares them on random trees and forests.
 */
#include <stdint.h>

/* Python's (-x) % t for x >= 0, t > 0. */
static inline int64_t neg_mod(int64_t x, int64_t t) { return (t - x % t) % t; }

/* The greedy binary edge assignment over a tree's edges in edge order (by depth, parent, id):
 * fasttree.planner._greedy_all_scalar / _greedy_scalar. Per edge e: its parent's node id cp[e],
 * the child's queries q[e] and length lnf[e], the parent's queries n_par[e]; the parent's group
 * length is root_len[e] when par_edge[e] < 0 (a root), else eff[par_edge[e]] (an earlier edge's
 * result). Writes dec[e] (1: concatenated) and eff[e] (the child's group length). */
void ft_greedy(int64_t n_edges, const int64_t *cp, const int64_t *q, const double *lnf, const int64_t *n_par,
               const int64_t *par_edge, const double *root_len, double ag, double bg, double gamma, int64_t tq0,
               int64_t tq1, int64_t tk0, int64_t tk1, int8_t *dec, double *eff) {
    int64_t prev = -2, n = 0;
    double cn = 0.0, pk0 = 0.0, pk1 = 0.0;
    for (int64_t e = 0; e < n_edges; e++) {
        const int64_t p = cp[e], qe = q[e];
        const double ln = lnf[e];
        const double lv = par_edge[e] < 0 ? root_len[e] : eff[par_edge[e]];
        /* Cmm(q, len_child) and gamma * q of the edge (as _greedy_all_scalar computes them) */
        const int big = qe > tq1;
        const double pad_kc = (double)(big ? tk0 : tk1) - ln;
        double cc = (double)neg_mod(qe, big ? tq0 : tq1) * ln * ag;
        cc += (pad_kc > 0.0 ? pad_kc : 0.0) * (double)qe * bg;
        const double gq = gamma * (double)qe;
        if (p != prev) {
            prev = p;
            n = n_par[e];
            pk0 = lv < (double)tk0 ? (double)tk0 - lv : 0.0;
            pk1 = lv < (double)tk1 ? (double)tk1 - lv : 0.0;
            if (n > tq1)
                cn = ag * ((double)neg_mod(n, tq0) * lv) + bg * (pk0 * (double)n);
            else
                cn = ag * ((double)neg_mod(n, tq1) * lv) + bg * (pk1 * (double)n);
        }
        const int64_t m = n - qe;
        double cm;
        if (m > tq1)
            cm = ag * ((double)neg_mod(m, tq0) * lv) + bg * (pk0 * (double)m);
        else
            cm = ag * ((double)neg_mod(m, tq1) * lv) + bg * (pk1 * (double)m);
        const double t = ln + lv;
        double ccat;
        if (qe > tq1)
            ccat = ag * ((double)neg_mod(qe, tq0) * t) + bg * ((t < (double)tk0 ? (double)tk0 - t : 0.0) * (double)qe);
        else
            ccat = ag * ((double)neg_mod(qe, tq1) * t) + bg * ((t < (double)tk1 ? (double)tk1 - t : 0.0) * (double)qe);
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

/* The 1-chains of the chained groups (fasttree.planner._chain_slots): chain c starts at node
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

void ft_chain_fill(int64_t n, const int64_t *nodes, const int64_t *parents, const int8_t *assign,
                   const int64_t *slot_indptr, const int64_t *lengths, const int32_t *slots, const int64_t *first,
                   int64_t *scratch, int32_t *out) {
    for (int64_t c = 0; c < n; c++) {
        int64_t v = nodes[c], k = 0;
        scratch[k++] = v;
        while (assign[v] == 1 && parents[v] >= 0) {
            v = parents[v];
            scratch[k++] = v;
        }
        int32_t *dst = out + first[c];
        for (int64_t s = k - 1; s >= 0; s--) {
            const int64_t u = scratch[s], len = lengths[u];
            const int32_t *src = slots + slot_indptr[u];
            for (int64_t i = 0; i < len; i++) dst[i] = src[i];
            dst += len;
        }
    }
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
