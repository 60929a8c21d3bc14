// Host-side launch policy of the KDA kernels: pure functions of the problem's shape (no CUDA, no
// environment), so the launchers (fwd/kda_fwd.cu, bwd/kda_bwd.cu, which add the environment
// overrides) and the host emulator (tests/emu) decide the same way.
#pragma once

#include <algorithm>

#include "kda/kda_problem.h"

namespace kernel_fun::kda {

// Every warp does the whole chunk for its 16 value columns, so a CTA's per-chunk time is set by
// what its warps share: shared-memory bandwidth (128 B/clk/SM) for the chunk's fill plus every
// warp's ldmatrix reads of the K-wide tiles (~60 KB per warp per chunk at K=128), with a floor of
// one warp's own serial chain. Modelled cost = waves x per-chunk time; the smallest wins.
// Since the fifth backward session the scans read the K-wide tiles once per warpgroup (wgmma), not
// per warp: this model predates that. Its fixed-length picks were re-measured against forced widths
// on 2026-12-03 (scripts/bench_kda_scan.py, docs/notes/2026-12-03-scan-shadow.md): each within 0.5%
// of the other width or faster.
// BV=32 is not supported: on the H200 it never won (B1 T32768 H32: 1.65 ms at 32 vs 1.53 at 64;
// B1 T8192 H16: 0.415 vs 0.400; K=V=64: 0.182 vs 0.152).
struct ScanChoice {
  int bv;       // V-slice width, 64 or 128
  double cost;  // modelled time: waves of CTAs x the per-chunk cost of one CTA step
};
constexpr int kPolicySMs = 132;  // the H100 / H200 SM count the models assume
// KB of one scan stage: w, qg, kg + Aqk, Akk + the value tile, padded
inline double scan_fill_kb(int K, int bv) { return 52.0 * (K / 128.0) + 18.0 + bv / 8.0; }
// scan CTAs one SM holds (double-buffered stages)
inline int scan_ctas_per_sm(int K, int bv) { return 2 * scan_fill_kb(K, bv) <= 110 ? 2 : 1; }
// Varlen batches consider only BV = 128 wherever V allows: their documents' chains differ in length,
// so the wave count below does not describe them, and on the H200 (2026-12-03, sixteenth session;
// scripts/bench_kda_scan.py) the 6-document H32 case's forward scan took 0.254 ms at 128 against
// 0.331 at 64, the model's pick.
inline ScanChoice scan_choice(const KdaProblem& p) {
  constexpr int kSMs = kPolicySMs;
  const long rows = static_cast<long>(p.HV) * p.N;
  const double kw = p.K / 128.0;
  const bool varlen_wide = p.cu_seqlens && p.V % 128 == 0;
  ScanChoice best{64, 0.0};
  for (int bv : {128, 64}) {
    // with identity columns a slice is all real or all virtual columns (fwd_scan_cta)
    if (p.V % bv != 0 || p.id_cols % bv != 0 || (varlen_wide && bv != 128)) continue;
    const int warps = bv / 16;
    const double fill_kb = scan_fill_kb(p.K, bv);
    const double warp_kb = 48.0 * kw + 12.0;  // ldmatrix bytes one warp reads
    const int per_sm = scan_ctas_per_sm(p.K, bv);
    const double chunk = std::max(per_sm * (fill_kb + warps * warp_kb), 190.0 * kw + 60.0);
    const long ctas = rows * (p.V / bv);
    const long waves = (ctas + static_cast<long>(kSMs) * per_sm - 1) / (static_cast<long>(kSMs) * per_sm);
    const double cost = waves * chunk;
    if (best.cost == 0 || cost < best.cost) best = {bv, cost};
  }
  return best;
}

// The streamed forward (kda_fwd.cu's kda_fwd_streamed; opt-in, KERNEL_FUN_KDA_FWD_STREAMED, until it
// is timed on a GPU): the scan launched first, its CTAs resident and waiting, and kda_fwd_intra
// beside it on the other SMs (a programmatic dependent launch), each
// intra CTA publishing its chunk to the scan through a flag (p.chunk_ready). When few (sequence,
// value head, V-slice) chains leave most SMs idle during the scan, the intra work then runs on
// those SMs while the chains advance instead of before them.
// The scan waits for intra CTAs (the intra for nothing), so the overlap needs every scan CTA
// resident at once with SMs to spare for the intra: the scan's grid is at most `sms - 8` CTAs,
// counted against the device's own SM count (the launcher's num_sms(), not kPolicySMs). Where the
// two kernels cannot run at once anyway (CUDA_LAUNCH_BLOCKING=1, profilers and sanitizers that
// serialise launches), a chain that waits 2 ms for its next chunk stops and a resume pass after the
// intra finishes it (dev::wait_chunk_ready, kda_fwd_scan.cuh): never a hang. Fixed-length batches
// only: the intra's swapped grid hands out chunk c of every sequence before chunk c + 1
// (dev::streamed_chunk), which a varlen chunk map cannot do without a host sync.
// Model, fitted to the H200 (K = 128, 2026-12-03, twelfth session; docs/notes/2026-12-03-streamed-forward.md):
// one after the other, an intra CTA takes ~24.4 us at two per SM (1.515 ms for 16384 CTAs on 132
// SMs) and a scan step ~3.0 us at BV = 64, ~3.8 us at BV = 128 (long_b1_t32k unstreamed: 3.47 ms
// at BV = 128); streamed, the intra runs beside the chains at ~31 us per CTA (28-33 measured:
// long_b1_t32k, small) and a BV = 64 chain step takes ~3.9 us (bounded_b1: 0.517 ms for 128 steps),
// BV = 128 assumed ~4.9 (the same 1.28x; long_b1_t32k is intra-bound either way). The streamed
// time is the longer of the chains and the intra on the SMs the scan leaves; stream when it is at
// least 5% under the two kernels (the model sits within ~6% of every measured case).
struct StreamChoice {
  int bv = 0;           // the scan's V-slice width in the streamed forward, or 0: do not stream
  double cost = 0;      // modelled us
  double cost_now = 0;  // modelled us of the two kernels one after the other
};
// Whether the streamed forward with V-slices of bv can overlap on a device of `sms` SMs (the
// residency condition above; fwd_stream_possible: fixed length, at most 65535 chunk rows).
inline bool fwd_stream_safe(const KdaProblem& p, int bv, int sms) {
  if (!fwd_stream_possible(p) || sms < 16 || bv <= 0 || p.V % bv != 0) return false;
  return static_cast<long>(p.HV) * p.N * (p.V / bv) <= sms - 8;
}
// Chunks of the longest sequence: the fixed length's, or with cu_seqlens the front's host copy's
// (KdaOptions::max_seq_len), 0 where the front read none (torch.compile, use_graph). A chain's
// serial steps, so what the models below count.
inline long longest_chunks(const KdaProblem& p) {
  const long t = p.cu_seqlens ? p.opt.max_seq_len : p.T;
  return (t + kChunk - 1) / kChunk;
}
// Model (us) of the forward's two kernels one after the other (fitted with fwd_stream_choice's
// constants below): the intra's waves at two CTAs per SM, then the scan's waves of chains as long as
// the longest sequence at scan_choice's width.
inline double fwd_two_kernel_cost(const KdaProblem& p, int sms) {
  const double kw = p.K / 128.0;
  const long intra_ctas = static_cast<long>(p.max_chunks) * p.HV;
  const long slots = 2L * sms;
  const double intra_now = static_cast<double>((intra_ctas + slots - 1) / slots) * 24.4 * (0.4 + 0.6 * kw);
  const ScanChoice now = scan_choice(p);
  const long now_ctas = static_cast<long>(p.HV) * p.N * (p.V / now.bv);
  const long now_waves = (now_ctas + sms - 1) / sms;
  return intra_now + now_waves * longest_chunks(p) * (now.bv == 128 ? 3.8 : 3.0) * (0.5 + 0.5 * kw);
}
inline StreamChoice fwd_stream_choice(const KdaProblem& p, int sms) {
  StreamChoice best;
  if (!fwd_stream_safe(p, 64, sms) && !fwd_stream_safe(p, 128, sms)) return best;
  const double kw = p.K / 128.0;
  const double intra_us = 24.4 * (0.4 + 0.6 * kw);  // per CTA at two per SM, alone
  const double intra_beside_us = 31.0 * (0.4 + 0.6 * kw);  // the same beside the scan
  const long nts = longest_chunks(p);
  const long intra_ctas = static_cast<long>(p.max_chunks) * p.HV;
  best.cost_now = fwd_two_kernel_cost(p, sms);
  for (int bv : {64, 128}) {
    if (!fwd_stream_safe(p, bv, sms)) continue;
    const long ctas = static_cast<long>(p.HV) * p.N * (p.V / bv);
    const double step = (bv == 128 ? 4.9 : 3.9) * (0.5 + 0.5 * kw);
    const double chains = nts * step;
    const double intra = intra_ctas * intra_beside_us / (2.0 * (sms - ctas));
    const double cost = std::max(chains, intra) + intra_us;  // + the first chunk row's intra
    if (cost < 0.95 * best.cost_now && (best.bv == 0 || cost < best.cost)) {
      best.bv = bv;
      best.cost = cost;
    }
  }
  return best;
}

// The split scans (fwd/kda_fwd_split.cuh; issue 21 item 1): where few (sequence, value head, V-slice)
// chains leave most SMs idle and the chains are long, each sequence's chunks are cut into pieces of L
// chunks, for the forward's scan and (the mirror) the backward's; the model below is the forward's. Pass 1 runs every piece but the last from a zero state, carrying K more value
// columns from the identity (the product of the piece's transitions, Phi); a short fp32 chain forms
// each piece's true initial state (h_in(s + 1) = Phi_s h_in(s) + E_s); pass 2 is the ordinary scan
// over the pieces from those states (o, the per-chunk states, the final state). Each pass takes L
// steps per chain instead of the sequence's whole chunk count, for (V + K) / V more chains in pass 1.
// The intra runs alone before it (no overlap with the scan as in the streamed forward).
// Possible: few chains (HV N V / 64 at most the policy's SM count), at most kSplitMaxSeqs sequences
// (the piece map is one thread's loop), at least 4 chunks; the launcher's width divides V and K (the
// virtual columns are whole slices).
constexpr int kSplitMaxSeqs = 64;
inline bool fwd_split_possible(const KdaProblem& p) {
  return !p.recurrent && p.id_cols == 0 && p.N > 0 && p.N <= kSplitMaxSeqs && p.HV > 0 && p.V % 64 == 0 &&
         p.max_chunks >= 4 && static_cast<long>(p.HV) * p.N * (p.V / 64) <= kPolicySMs;
}
// The piece length for a wanted one: at least ceil(max_chunks / kSplitMaxExtraPieces), so the pieces'
// states stay bounded (kda_problem.h's split_piece_bound), and at least 1.
inline int split_chunks_for(const KdaProblem& p, int want) {
  const int least = (p.max_chunks + kSplitMaxExtraPieces - 1) / kSplitMaxExtraPieces;
  return std::max({want, least, 1});
}
struct SplitChoice {
  int chunks = 0;         // the piece length L, or 0: do not split
  int bv = 0;             // the scans' V-slice width
  double cost = 0;        // modelled us of the split forward
  double cost_other = 0;  // modelled us of the forward it would replace (streamed or two kernels)
};
// Model (us), from the constants fitted for the streamed forward (fwd_stream_choice; not yet fitted to
// a split forward measured on a GPU): the intra alone, then pass 1's and pass 2's waves of L steps
// (a pass-1 step assumed as long as an ordinary one, though it has no o), the chain (~1.5 us per
// piece) and ~12 us for the three small launches. A varlen batch's chains are its documents': the
// model counts L-chunk pieces of its longest document (longest_chunks, from the front's host copy;
// unknown under torch.compile or use_graph, and then it does not split) for every document, which
// overcounts the shorter ones' pieces. It splits where the model is at least 25% under the
// forward it replaces: that forward's model (fwd_stream_choice) was fitted before the scans' later
// gains and overestimates them (bounded_b1 streamed: 524 us modelled, ~400 measured on 2026-12-04),
// and the split's own step times are not yet measured.
inline double split_cost(const KdaProblem& p, int L, int bv, int sms) {
  const double kw = p.K / 128.0;
  const long nts = longest_chunks(p);
  const long S = (nts + L - 1) / L;
  const long rows = static_cast<long>(p.HV) * p.N;
  const long slots = static_cast<long>(sms) * scan_ctas_per_sm(p.K, bv);
  const double step = (bv == 128 ? 3.8 : 3.0) * (0.5 + 0.5 * kw);
  const long intra_ctas = static_cast<long>(p.max_chunks) * p.HV;
  const double intra = static_cast<double>((intra_ctas + 2L * sms - 1) / (2L * sms)) * 24.4 * (0.4 + 0.6 * kw);
  const long c1 = rows * (S - 1) * (p.V / bv) + rows * std::max(S - 2, 0L) * (p.K / bv);
  const long c2 = rows * S * (p.V / bv);
  const double t1 = static_cast<double>((c1 + slots - 1) / slots) * L * step;
  const double t2 = static_cast<double>((c2 + slots - 1) / slots) * L * step;
  return intra + t1 + 1.5 * S + t2 + 12.0;
}
// A forward that cannot stream (a varlen batch; a fixed-length one whose chains do not leave the
// intra SMs: 125-132 chains at V = 64) is compared with its two kernels one after the other, and
// splits only if its longest sequence has at least this many chunks. The model's chain costs ~1.5 us
// per piece where the chain kernel measured ~5-6 us (447c4f4, long_b1_t32k_h8), which matters where
// the pieces are few steps long: for sequences under 128 chunks the margin over the two kernels is
// within that error (two documents of 2048 tokens at 8 heads: modelled 118 against 170 us, ~150 with
// the chain as measured). Where the forward can stream, the streamed model's choice is the one to
// beat, and it already declines short sequences.
constexpr long kSplitUnstreamedMinChunks = 128;
inline SplitChoice fwd_split_choice(const KdaProblem& p, int sms) {
  SplitChoice best;
  const int nts = static_cast<int>(longest_chunks(p));
  if (!fwd_split_possible(p) || nts == 0 || sms < 16) return best;
  const bool streamable = fwd_stream_safe(p, 64, sms) || fwd_stream_safe(p, 128, sms);
  if (!streamable && nts < kSplitUnstreamedMinChunks) return best;
  // the forward it would replace: streamed where the model streams, else the two kernels
  const StreamChoice st = fwd_stream_choice(p, sms);
  best.cost_other = st.bv ? st.cost : fwd_two_kernel_cost(p, sms);
  double cost = 0;
  int chunks = 0, width = 0;
  for (int bv : {64, 128}) {
    if (p.V % bv != 0 || p.K % bv != 0) continue;
    for (int S = 2; S <= kSplitMaxExtraPieces; ++S) {
      const int L = split_chunks_for(p, (nts + S - 1) / S);
      if (L >= nts) continue;
      const double c = split_cost(p, L, bv, sms);
      if (chunks == 0 || c < cost) {
        cost = c;
        chunks = L;
        width = bv;
      }
    }
  }
  if (chunks > 0 && cost < 0.75 * best.cost_other) {
    best.chunks = chunks;
    best.bv = width;
    best.cost = cost;
  }
  return best;
}

// The short-chunk forward (fwd/kda_fwd_intra_c32.cuh: 32 tokens per chunk), for a forward that saves
// nothing for a backward (kda_fwd.cu's kda_fwd_chunk_choice says which calls may run it). Its intra
// does the 64-token intra's work in 0.80-0.86x the time (the in-chunk products are quadratic in the
// chunk size; 4 CTAs per SM); its scan takes twice the steps per chain, each cheaper than a 64-token
// step. Against the 64-token forward's two kernels one after the other it won on every bench case
// (the H100, 2026-12-05, scripts/fwd_chunk_ab.py: 0.89-0.95x where the chains fill the GPU or nearly,
// gva 0.91 and small 0.95 at 128 and 64 chains, and even with few long chains: bounded_b1 0.92,
// long_b1_t32k 0.96), and in fp16 alike (bounded_b16 0.88, gva 0.89, small 0.94, varlen 0.87: the H100,
// 2026-12-05, 32nd session), but not against the streamed forward (the intra beside the chains:
// bounded_b1 0.398 -> 0.452 ms, long_b1_t32k 1.70 -> 2.25) and it cannot split. Streamed itself (the
// 32-token intra beside the 32-token scan, KERNEL_FUN_KDA_FWD_CHUNK=32 where the call streams) it lost
// too: bounded_b1 0.391 -> 0.412 ms, long_b1_t32k 1.720 -> 2.043, where ~1.3-1.4 was expected from
// its kernels alone (why is open: docs/notes/2026-12-05-streamed-c32.md). So: wherever the 64-token
// forward would run its two kernels one after the other, neither streamed (`streams`, the launcher's
// decision) nor split (p.split_chunks, kda_split_choose's).
inline bool fwd_short_chunks_pay(const KdaProblem& p, bool streams) {
  return !streams && p.split_chunks == 0;
}

// The V-slice width of the forward's scan when it runs on its own (not streamed, not split: those
// decide theirs). The 64-token scan takes scan_choice's. The 32-token scan (fwd/kda_fwd_scan_c32.cuh)
// takes 64 (V is a multiple of 64 wherever the 32-token forward runs: kda_fwd_chunk_choice): at BV = 64 a CTA holds 71 KB of shared memory (two 35 KB stages) and
// 253 registers x 128 threads, so two chains share an SM and hide each other's per-step barriers,
// where at BV = 128 (254 x 256 threads) one chain holds a whole SM, as every 64-token scan does. The
// H100, 2026-12-05 (33rd session, scripts/fwd_chunk_ab.py, KERNEL_FUN_KDA_SCAN_BV=64 against
// scan_choice's 128): the 32-token forward bounded_b16 3.086 -> 3.054 ms, prod8192 (V = 256) 4.003 ->
// 3.963, gva 1.673 -> 1.655, small 0.487 -> 0.486, varlen 0.456 -> 0.441; the 64-token forward at
// BV = 64 lost (prod8192 4.06 -> 4.81), as scan_choice's model says.
inline int fwd_scan_bv_alone(const KdaProblem& p) {
  return p.fwd_chunk == kC32 ? 64 : scan_choice(p).bv;
}

// Whether the backward runs its re-scan and its dh scan as ONE launch (bwd/kda_bwd_scans.cuh):
// when the CTAs of both fit in one wave, the launch takes the longer scan's time instead of the sum
// of both (B = 1 and few heads: long_b1_t32k pairs 64 + 64 CTAs on 132 SMs). With more CTAs than
// one wave the waves add up either way, and the separate launches are kept. p: one batch slice.
inline bool bwd_pair_scans(const KdaProblem& p, int bv) {
  const long ctas = static_cast<long>(p.HV) * p.N * (p.V / bv);
  return ctas > 0 && 2 * ctas <= static_cast<long>(kPolicySMs) * scan_ctas_per_sm(p.K, bv);
}

// The width of the dh scan when it runs as its own launch (kda_bwd_dh_scan: the backward's two scans
// are not paired; paired, kda_bwd_scans runs both at the forward scan's width), given the forward
// scan's (fwd_bv), for the launcher (kda_bwd.cu's kda_bwd_dh_scan_bv) and the emulator alike:
// - streamed (the grads kernel beside it, bwd_stream_wanted below): 128 where V allows. Its chains
//   halve (long_b1_t32k: 64 -> 32 CTAs on 132 SMs), which leaves the grads CTAs beside it 100 SMs
//   instead of 68; each chain step is longer (the dh scan 1.36 -> 1.95 ms there), the training call
//   shorter. Measured on the H100 (2026-12-05, thirty-seventh session; one process, two runs each,
//   the forward streamed as in production): long_b1_t32k 6.79 / 6.80 -> 6.71 / 6.67 ms,
//   long_b1_t128k 26.32 / 26.37 -> 26.01 / 26.06.
// - varlen batches: 64 where V allows, where the forward scan takes 128 (scan_choice): on the H200
//   (2026-12-03, sixteenth session) the 6-document H32 case's dh scan took 0.172 ms at 64 against
//   0.188 at 128, while its forward scan was 0.331 at 64 against 0.254 at 128.
// - elsewhere both scans take the same width.
inline int dh_scan_bv(const KdaProblem& p, int fwd_bv, bool streamed) {
  if (streamed) return p.V % 128 == 0 ? 128 : 64;
  return p.cu_seqlens && p.V % 64 == 0 ? 64 : fwd_bv;
}

// Batches per backward slice (bwd/kda_bwd_slice.h): B (one pass) for varlen or B = 1, else the
// smallest slice whose two scans model no more time than one pass over the whole batch (a serial
// scan at K = 128 runs one CTA per SM, so 512 scan CTAs cost 4 waves at once or as 4 slices of 128).
inline int bwd_slice_batches(const KdaProblem& p) {
  if (p.cu_seqlens || p.B <= 1) return p.B;
  KdaProblem s = p;
  const double whole = scan_choice(p).cost;
  for (int nb = 1; nb < p.B; ++nb) {
    s.B = s.N = nb;
    // the last slice may be smaller: its scan costs at most a full slice's
    if ((p.B + nb - 1) / nb * scan_choice(s).cost <= whole) return nb;
  }
  return p.B;
}

// The streamed backward (kda_bwd.cu; KERNEL_FUN_KDA_BWD_STREAMED=0 turns it off): kda_bwd_grads launched
// beside the dh scan (a programmatic dependent launch), its grid in the order the dh scan stores
// the checkpoints (the last chunk of every sequence first), each grads CTA waiting until the
// checkpoint it reads is stored. Few chains leave most SMs idle during the dh scan (long_b1_t32k: 64
// chains on 132 SMs), and the grads kernel, which needs a whole SM per CTA, runs on those SMs
// meanwhile. It needs the states the forward saved (the dh scan alone, not paired with the
// re-scan: save_states_pays below). Measured on the H100 (2026-12-06, thirty-ninth session; training
// calls, one process, two runs each, KERNEL_FUN_KDA_BWD_STREAMED=2 against the rule before, which
// counted the chains at the unstreamed width, 64 columns, and streamed at most kPolicySMs / 2 of
// them): small (B4 T4096 H16: 128 chains at 64, 64 at 128) 1.900 / 1.883 -> 1.876 / 1.872 ms, gva
// (B8 T8192 HV16: 128 chains at 128) 7.731 / 7.712 -> 7.511 / 7.499.
// So where V allows the 128-column dh scan that streaming takes (dh_scan_bv) and the grads kernel is
// the unbounded-gate one, every pass that can stream does (bwd_stream_possible: at most 128 chains at
// 128); at K = 64 that class includes shapes that paired their scans and saved no states before
// (67-128 chains at 64 columns: -4% to -8%, fortieth session). Elsewhere -- V not a multiple of 128
// (the dh scan at 64 columns), or the bounded-gate (midpoint, dev::block_midpoint_ok) grads kernel --
// while the dh scan leaves at least an eighth of the SMs to the grads CTAs (kStreamFreeSMs). Measured
// on the H100 (2026-12-06, fortieth session; training calls, one process, two runs each): V 64 / 192
// at 80-112 chains 0.3-1.8% faster streamed, at 128 chains no faster; the bounded-gate kernel at 128
// chains at 128 columns (bounded_b16's batch slices) 12.800 / 12.776 -> 12.967 / 12.983 ms streamed,
// where the unbounded one gained there (prod8192's slices 17.313 / 17.276 -> 17.146 / 17.152, k3_h32's
// 13.965 / 13.925 -> 13.681 / 13.702); the bounded kernel with few chains gains (bounded_b1,
// long_b1_t32k). docs/notes/2026-12-06-stream-bounds-and-bench.md has every row. The grads CTAs wait
// for the dh scan and never the other way round, and every dh-scan CTA is resident before any grads
// CTA starts (the dependent launch starts only then), so a wait always ends. A pure function of the
// pass's shape and gate, so that the forward's decision to save its states (save_states_pays) and the
// backward's to stream agree.
constexpr int kStreamFreeSMs = kPolicySMs / 8;
inline bool bwd_stream_wanted(const KdaProblem& p) {
  if (!bwd_stream_possible(p)) return false;
  const int bv = dh_scan_bv(p, scan_choice(p).bv, true);
  if (bv == 128 && !dev::block_midpoint_ok(p.opt)) return true;
  return static_cast<long>(p.HV) * p.N * (p.V / bv) <= kPolicySMs - kStreamFreeSMs;
}

// Whether the passes of a backward in slices of slice_B batches stream: each pass (the whole batch
// where it is not sliced, else each batch slice: kda_problem.h's backward_pass_problem) as
// bwd_stream_wanted says for its shape. A sliced backward (bwd_slice_batches: prod8192 in 4 slices
// of 4 batches, k3_h32 in 2 of 4, bounded_b16 in 2 of 8) streams slice by slice, each slice's dh
// scan zeroing the counters and each slice's grads kernels ending after its dh scan.
inline bool bwd_pass_streams(const KdaProblem& p, int slice_B) {
  return bwd_stream_wanted(backward_pass_problem(p, slice_B));
}

// Whether a training forward's scan writes the state before every chunk for its backward (which then
// runs no re-scan: KdaBwdParams::saved_states), given the buffer (the Python front allocates it,
// [max_chunks, HV, V, K], unless KERNEL_FUN_KDA_SAVE_STATES=0). Where the backward would pair its
// re-scan with the dh scan in one launch (bwd_pair_scans, on one batch slice at the scan's width:
// few chains, B = 1 with few heads) the re-scan costs nothing beside the longer dh scan, while the
// checkpoint stores lengthen the forward's chain steps: on the H200 (2026-12-04) B1 T32768 H32's
// training call 7.36 -> 7.66 ms and B1 T8192 H16's 1.31 -> 1.36 with them, where prod8192 went
// 18.91 -> 17.70, bounded B16 13.68 -> 13.16 and varlen 1.99 -> 1.89. There the buffer served the
// backward's re-scan instead (no per-slice h_ckpt) until the streamed backward (bwd_stream_wanted,
// fixed length), which needs the states and won them back on the H100 (2026-12-05): long_b1_t32k
// 6.90 -> 6.80 ms, long_b1_t128k 27.00 -> 26.40, bounded_b1 through a CUDA graph 1.54 -> 1.46.
// Where the scans are split (p.split_chunks, decided before this) the backward runs no paired scans,
// and the forward's pass 2 writes the states in its stride: saved, so the backward runs no split
// re-scan (passes 1 and 2 and the chain). A pure function of the shape and the options (the split
// comes from them, not from the environment), so the forward and its backward always decide alike.
inline bool save_states_pays(const KdaProblem& p) {
  if (p.split_chunks > 0) return true;
  // one pass of the backward: the whole batch or its first slice (varlen: one pass); as
  // bwd_pass_streams, on the pass's shape formed once here
  const KdaProblem s = backward_pass_problem(p, bwd_slice_batches(p));
  return bwd_stream_wanted(s) || !bwd_pair_scans(s, scan_choice(s).bv);
}

// The fp32 token recurrence (recur/kda_recur.cuh) instead of the chunk kernels, for problems whose
// every sequence fits in one chunk: there the chunk form saves no work, and its 16-bit intermediates
// set the error (dA_log summed over the tokens of one chunk; docs/notes/2026-12-03-recurrence.md).
// Possible: fixed length T <= 64, or varlen with at most 64 tokens in all (each document then fits;
// the lengths themselves stay on the device). Default: also a backward workspace of at most
// kRecurStateBudget (it holds the state before every token: ~1.1 MiB per sequence, value head and
// 32-column value slice at K = 128), which keeps it to small problems (about one wave of backward
// CTAs, one per slice, each running the tokens serially): a big batch of short sequences is faster
// on the chunk path (docs/notes/2026-12-03-recurrence.md has the timings).
constexpr int64_t kRecurStateBudget = int64_t{256} << 20;
inline bool recurrent_possible(const KdaProblem& p) {
  const bool one_chunk = p.cu_seqlens ? static_cast<int64_t>(p.B) * p.T <= kChunk : p.T <= kChunk;
  return one_chunk && p.id_cols == 0 && p.N > 0 && p.HV > 0 && p.V % kRecurCols == 0 &&
         (p.K == 64 || p.K == 128);
}
inline bool recurrent_default(const KdaProblem& p) {
  return recurrent_possible(p) &&
         static_cast<int64_t>(p.N) * p.HV * (p.V / kRecurCols) * recur_slice_floats(p.K) * 4 <= kRecurStateBudget;
}

}  // namespace kernel_fun::kda
