// The greedy pick's order (kernels/greedy_pick.h), which the GPU's argmax kernels are built from,
// held to std::max_element (the CPU's greedy pick) on the host, so that CI, which has no GPU,
// checks the rule itself: every way the kernels combine kept pairs — the op kernel's
// shared-memory tree, the fused step's warp butterfly, and merges in any order — must pick
// max_element's index, over logits full of ties, NaNs, infinities and signed zeros.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/rng.h"
#include "kernels/greedy_pick.h"

namespace ptllm {
namespace {

struct Kept {
  float best = -std::numeric_limits<float>::infinity();
  int arg = -1;
};

int maxElementIndex(const std::vector<float>& x) {
  return int(std::max_element(x.begin(), x.end()) - x.begin());
}

// Thread t of `threads` scans v = t, t + threads, ... in increasing order (both kernels' loop).
std::vector<Kept> stridedScans(const std::vector<float>& x, int threads) {
  std::vector<Kept> k(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t)
    for (int v = t; v < int(x.size()); v += threads) pickConsider(k[t].best, k[t].arg, x[v], v);
  return k;
}

// greedyAdvanceKernel: a power-of-two block; at each level thread i < half merges slot i + half.
int sharedMemoryTree(const std::vector<float>& x, int threads) {
  std::vector<Kept> k = stridedScans(x, threads);
  for (int half = threads / 2; half > 0; half /= 2)
    for (int i = 0; i < half; ++i)
      pickMerge(k[i].best, k[i].arg, k[i + half].best, k[i + half].arg);
  return pickToken(x[0], k[0].arg);
}

// greedyTail: 32 lanes, every lane merging its partner's pair (lane ^ o) at once, o = 16 .. 1;
// lane 0's pair is the pick (every lane ends with the same pair).
int warpButterfly(const std::vector<float>& x) {
  std::vector<Kept> k = stridedScans(x, 32);
  for (int o = 16; o > 0; o /= 2) {
    const std::vector<Kept> before = k;
    for (int lane = 0; lane < 32; ++lane)
      pickMerge(k[lane].best, k[lane].arg, before[lane ^ o].best, before[lane ^ o].arg);
  }
  for (int lane = 1; lane < 32; ++lane) EXPECT_EQ(k[lane].arg, k[0].arg) << "lane " << lane;
  return pickToken(x[0], k[0].arg);
}

// Any tree: pairs merged in a random order, into either side.
int randomTree(const std::vector<float>& x, int threads, Rng& rng) {
  std::vector<Kept> k = stridedScans(x, threads);
  while (k.size() > 1) {
    const size_t a = rng.below(k.size());
    size_t b = rng.below(k.size() - 1);
    if (b >= a) ++b;
    pickMerge(k[a].best, k[a].arg, k[b].best, k[b].arg);
    k.erase(k.begin() + std::ptrdiff_t(b));
  }
  return pickToken(x[0], k[0].arg);
}

// Logits drawn from a few values, so that ties are common; `nanShare` of them NaN.
std::vector<float> trickyLogits(int V, Rng& rng, double nanShare) {
  const float inf = std::numeric_limits<float>::infinity();
  const float values[] = {-inf, -2.5f, -0.0f, 0.0f, 1.0f, 3.0f, 3.0f, inf};
  std::vector<float> x(static_cast<size_t>(V));
  for (float& v : x)
    v = rng.uniformDouble() < nanShare ? std::nanf("") : values[rng.below(std::size(values))];
  return x;
}

TEST(GreedyPick, EveryMergeTreePicksWhatMaxElementPicks) {
  Rng rng(20261204);
  int cases = 0;
  for (int V : {1, 2, 3, 31, 32, 33, 65, 257, 1000, 50257})
    for (double nanShare : {0.0, 0.1, 0.5, 0.95, 1.0})
      for (int rep = 0; rep < 4; ++rep) {
        std::vector<float> x = trickyLogits(V, rng, nanShare);
        if (rep == 1) x[0] = std::nanf("");  // max_element never leaves a NaN at index 0
        if (rep == 2 && V > 1) x[size_t(V) - 1] = std::numeric_limits<float>::infinity();
        if (rep == 3) std::fill(x.begin(), x.end(), -0.0f), x[size_t(V) / 2] = 0.0f;  // ±0 tie
        const int want = maxElementIndex(x);
        SCOPED_TRACE(testing::Message() << "V=" << V << " nanShare=" << nanShare << " rep=" << rep
                                        << " want=" << want);
        EXPECT_EQ(sharedMemoryTree(x, 256), want);
        EXPECT_EQ(sharedMemoryTree(x, 8), want);
        EXPECT_EQ(warpButterfly(x), want);
        for (int threads : {1, 7, 32, 100}) EXPECT_EQ(randomTree(x, threads, rng), want);
        ++cases;
      }
  EXPECT_EQ(cases, 200);
}

TEST(GreedyPick, FirstOfEqualLargestWinsWhateverTheThreadSplit) {
  // Two equal maxima: the first wins in every split, as in max_element.
  std::vector<float> x(300, -1.0f);
  x[297] = 5.0f;
  x[41] = 5.0f;
  EXPECT_EQ(maxElementIndex(x), 41);
  EXPECT_EQ(sharedMemoryTree(x, 256), 41);
  EXPECT_EQ(warpButterfly(x), 41);
  // All NaN but index 0 finite: index 0 stays; all NaN: 0.
  std::vector<float> nans(70, std::nanf(""));
  EXPECT_EQ(warpButterfly(nans), 0);
  nans[0] = -1e30f;
  EXPECT_EQ(warpButterfly(nans), 0);
  nans[69] = -1e29f;  // a later finite larger value does win
  EXPECT_EQ(maxElementIndex(nans), 69);
  EXPECT_EQ(warpButterfly(nans), 69);
  EXPECT_EQ(sharedMemoryTree(nans, 256), 69);
}

}  // namespace
}  // namespace ptllm
