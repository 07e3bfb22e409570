// The greedy pick's order (Ops::greedyAdvance: std::max_element's token over the logits) as
// pieces a parallel argmax is built from, for the GPU's kernels (decode_math.cuh: the op
// kernel's shared-memory tree, the fused decode step's warp butterfly) and for the CPU test
// that holds every such tree to std::max_element (tests/test_greedy_pick.cpp). A kept pair is
// (best, arg), arg -1 for nothing kept yet.
//   pickConsider: one thread's scan in increasing index keeps the first largest non-NaN logit;
//   pickMerge: of two kept pairs the larger value, or on a tie the lower index, wins — one
//     total order on the non-NaN (value, index) pairs, so any tree of merges gives one token;
//   pickToken: max_element starts at logits[0] and never moves onto a NaN (NaN < x and
//     x < NaN are both false), so a NaN at index 0 is never replaced; all-NaN also gives 0.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define PTLLM_PICK_FN __host__ __device__ __forceinline__
#else
#define PTLLM_PICK_FN inline
#endif

namespace ptllm {

PTLLM_PICK_FN bool pickIsNan(float x) {
#if defined(__CUDA_ARCH__)
  return isnan(x);
#else
  return std::isnan(x);
#endif
}

PTLLM_PICK_FN void pickConsider(float& best, int& arg, float x, int v) {
  if (!pickIsNan(x) && (arg < 0 || x > best)) best = x, arg = v;
}

PTLLM_PICK_FN void pickMerge(float& best, int& arg, float otherBest, int otherArg) {
  if (otherArg >= 0 && (arg < 0 || otherBest > best || (otherBest == best && otherArg < arg)))
    best = otherBest, arg = otherArg;
}

PTLLM_PICK_FN int pickToken(float first, int arg) {
  return pickIsNan(first) || arg < 0 ? 0 : arg;
}

}  // namespace ptllm

#undef PTLLM_PICK_FN
