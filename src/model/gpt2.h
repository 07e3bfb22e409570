// The GPT-2 model: parameters, training forward/backward, and KV-cached inference, all through
// the Ops interface. Forward linear layers (Q/K/V/O, MLP fc_in/fc_out) may run on a gated
// fast path picked per call from the PathSet; backward matmuls, AdamW and the tied head's
// logits always run on the canonical f32 ops (spec: activation scope).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "kernels/ops.h"
#include "kernels/registry.h"
#include "model/config.h"

namespace ptllm {

class PathSet;

// One named parameter tensor inside the flat parameter buffer.
struct ParamInfo {
  std::string name;  // HF GPT-2 name without prefix, e.g. "h.0.attn.c_attn.weight"
  Shape shape;
  int64_t offset = 0;  // in floats
  bool decay = false;  // weight decay applies (2-D weights)
  int64_t numel() const { return numelOf(shape); }
};

// The parameters a config describes, in the flat buffer's order, with their offsets: known
// before anything is allocated (the loader checks a file's tensors against it first).
std::vector<ParamInfo> gpt2ParamLayout(const ModelConfig& cfg);

class Gpt2 {
 public:
  Gpt2(Ops& ops, const ModelConfig& cfg);
  ~Gpt2();

  const ModelConfig& config() const { return cfg_; }
  Ops& ops() { return ops_; }
  const std::vector<ParamInfo>& paramInfos() const { return params_; }
  const ParamInfo* findParam(const std::string& name) const;
  int64_t numParams() const { return numParams_; }
  Tensor& paramData() { return paramBuf_; }  // [numParams], backend memory
  Tensor& gradData() { return gradBuf_; }    // [numParams]
  float* param(const ParamInfo& p) { return paramBuf_.data() + p.offset; }
  float* grad(const ParamInfo& p) { return gradBuf_.data() + p.offset; }

  // GPT-2 initialisation: N(0, 0.02); residual projections N(0, 0.02/sqrt(2L)); biases 0;
  // LayerNorm weight 1, bias 0.
  void initRandom(uint64_t seed);

  // Fast paths. Without a PathSet (or with an empty one) everything runs on f32.
  void setPaths(PathSet* paths) {
    paths_ = paths;
    invalidatePackedWeights();
  }
  PathSet* paths() const { return paths_; }
  // Drops every packed weight copy (called at the top of every train step; re-packed lazily).
  void invalidatePackedWeights();
  // Packs every forward linear weight for the active path now (before sampling).
  void prepareForInference();
  // The current packed weight copies (for tests that poison them to prove who reads them).
  std::vector<Buffer*> packedBuffers();
  // Name of the path the last forward linear ran on ("f32" or a registry name).
  const std::string& lastLinearPath() const { return lastLinearPath_; }
  // Where the active fast path may run, as the model-level gates decided (model/model_gate.h):
  // the training forward (forward(), which also computes eval losses) and/or inference
  // (forwardCached()). Both allowed by default; the matmul gates still decide first.
  void setPathUse(bool training, bool inference) {
    pathInTraining_ = training;
    pathInInference_ = inference;
  }
  bool pathAllowedInTraining() const { return pathInTraining_; }
  bool pathAllowedInInference() const { return pathInInference_; }
  // Forces the canonical f32 path for every forward while set (drift sentinel recomputes, the
  // model-level gates' f32 side).
  void setForceF32(bool on) { forceF32_ = on; }
  // One forward linear layer's real weight and input (after a forward), for the workload gate:
  // the first layer's four linears, at most maxRows rows of input each.
  struct LinearSample {
    std::string label;  // weight name
    int M, K, N;
    std::vector<float> in, w, bias;
  };
  std::vector<LinearSample> linearSamples(int maxRows);
  // The fast path the next forward would use (nullptr: f32), waiting for its gate.
  const PathEntry* fastPath(bool training);

  // ---- training ----
  // Forward over inputs[B,T] (T <= blockSize). With targets, returns the mean loss (targets < 0
  // are ignored); without, returns 0 and leaves logits for logitsHost().
  float forward(const int32_t* inputs, const int32_t* targets, int B, int T);
  void zeroGrad();
  // Accumulates gradients of the mean loss of the last forward into gradData().
  void backward();
  // Global gradient L2 norm; if above maxNorm, scales the gradients down to it. Returns the norm
  // before clipping.
  float clipGradNorm(float maxNorm);
  void adamwStep(float lr, float beta1, float beta2, float eps, float weightDecay);
  int optimizerStep() const { return adamStep_; }
  void setOptimizerStep(int t) { adamStep_ = t; }
  Tensor& adamM();
  Tensor& adamV();
  // Logits of the last forward, [B*T, V], copied to the host.
  std::vector<float> logitsHost() const;
  // Residual stream after each block of the last forward, [nLayer][B*T*C] (diagnostics).
  std::vector<std::vector<float>> blockOutputsHost() const;

  // ---- inference with a KV cache (batch 1) ----
  void resetCache();
  int cachedTokens() const { return cachePos_; }
  // Runs tokens[n] at positions cachedTokens()..+n (must fit in blockSize) and writes the
  // logits of the last one to logitsOut[V] (host memory).
  void forwardCached(const int32_t* tokens, int n, float* logitsOut);
  // On a backend with step graphs (CUDA), a one-token step is recorded once per path and then
  // replayed: one launch per token instead of one per op. On by default; the recording is
  // dropped with the packed weights (every train step) and when the paths change.
  void setStepGraphs(bool on) {
    stepGraphsOn_ = on;
    stepGraphs_.clear();
  }
  bool usedStepGraph() const { return usedStepGraph_; }  // the last forwardCached replayed one
  // A recorded step is one fused launch (Ops::decodeStepFused) where the backend has one and
  // the path allows it (f32, or a path with PathEntry::fusedDecode), or the op-by-op kernels.
  // The two compute every element alike (bit-identical, tests/test_cuda_decode_step.cpp), so
  // the choice is speed only. Auto (the default): both are recorded and timed on a path's first
  // step, the faster is kept, and the choice outlives the recordings (remade after updates). On:
  // the fused launch wherever it can run. Off: the op kernels. `clusterBlocks` 0: the backend's
  // choice of fused launch size (benchmarks vary it).
  // The fused launch has forms of its own (Ops::decodeStepForms(), bit-identical too): Auto
  // times each of them and the op kernels; On uses `form` (0: the backend's default).
  enum class FusedSteps { Off, Auto, On };
  void setFusedSteps(FusedSteps mode, int clusterBlocks = 0, int form = 0) {
    fusedSteps_ = mode;
    fusedClusterBlocks_ = clusterBlocks;
    fusedForm_ = form;
    stepGraphs_.clear();
    stepForm_.clear();
  }
  // Blocks of the fused launch the last forwardCached replayed (0: none, op-by-op kernels),
  // and the form it asked for (0 with the op kernels, or the backend's default under On).
  int usedFusedStep() const { return usedFusedStep_; }
  int usedFusedForm() const { return usedFusedForm_; }
  // Greedy decoding on the device (a backend with step graphs, canDecodeGreedy()): feeds
  // `first`, then each token the device picks itself (the first largest logit, as sampleToken
  // at temperature 0), n steps in all, with no host round trip per token. The picks — pick k
  // follows the k-th fed token — reach onToken in order as they are read back in chunks;
  // logitsOut[V] gets the last step's logits. Needs cachedTokens() + n <= blockSize. Returns
  // false, having done nothing, where the step cannot be recorded (then decode token by token).
  // Full runs of kGreedyRunSteps steps replay one recorded graph of that many [step, pick]
  // pairs (no launch from the host between steps; a fused step makes its pick itself, one
  // launch per token); shorter runs and the rest replay the step graph and queue the pick per
  // token. setGreedyRunGraphs(false): always the latter (benchmarks compare the two; the picks
  // and logits are the same). Where the backend's fused step can run a whole run in one launch
  // (Ops::DecodeStepArgs::greedySteps), the recorded run is that one launch;
  // setPersistentGreedyRuns(false) records the kGreedyRunSteps launches instead.
  // Speculative greedy runs (setSpeculativeLanes(k), k > 1; where the backend's fused step
  // has them, Ops::DecodeStepArgs::speculativeLanes): given the cache's tokens (cachedIds[0,
  // cachedTokens())), decodeGreedy drafts tokens from them and checks k - 1 drafts per step
  // with k steps side by side, keeping the accepted ones — the picks and logits are the same
  // bits as without; what changes is how many steps run one after another. Where it cannot
  // (no room for the lanes, the backend refuses), the run goes on as without.
  bool canDecodeGreedy() const;
  bool decodeGreedy(int32_t first, int n, const std::function<void(int32_t)>& onToken,
                    float* logitsOut, const int32_t* cachedIds = nullptr);
  // On by default: 6 lanes (run 53, docs/performance.md: 5% faster per token than 4 on the
  // bundled model; a device that holds fewer at once runs fewer); 0 or 1: off.
  static constexpr int kDefaultSpeculativeLanes = 6;
  void setSpeculativeLanes(int lanes) { speculativeLanes_ = lanes; }
  int speculativeLanes() const { return speculativeLanes_; }
  // The tokens the last decodeGreedy emitted speculatively, the verify steps they took and the
  // lanes it ran (fewer than asked where the device holds fewer at once; 0, 0, 0: it ran
  // without).
  int lastSpeculativeTokens() const { return lastSpecTokens_; }
  int lastSpeculativeSteps() const { return lastSpecSteps_; }
  int lastSpeculativeLanes() const { return lastSpecLanes_; }
  static constexpr int kGreedyRunSteps = 32;
  void setGreedyRunGraphs(bool on) { greedyRunGraphs_ = on; }
  void setPersistentGreedyRuns(bool on) {
    if (on != persistentGreedyRuns_)
      for (auto& [path, rec] : stepGraphs_) {
        rec.greedyRun.reset();  // re-recorded on next use
        rec.persistentRun = false;
      }
    persistentGreedyRuns_ = on;
  }
  // Whether the last decodeGreedy replayed a recorded run as one launch (greedySteps).
  bool usedPersistentGreedyRun() const { return usedPersistentRun_; }
  // Microseconds one replay of the current path's recorded decode step takes at the current
  // position (back-to-back replays: device time plus launch gaps, no per-token host work);
  // 0 when no step has been recorded. For benchmarks: it replays the step in place.
  double recordedStepMicros();

 private:
  struct Linear;
  struct Layer;
  struct Acts;
  void buildParams();
  void checkTokens(const int32_t* ids, int64_t n) const;  // each in [0, vocabSize), or fail
  void linear(Linear& l, float* out, const float* in, int M, const PathEntry* path);
  void pack(Linear& l, const PathEntry* path);
  void linearBackward(Linear& l, float* dIn, const float* dOut, const float* in, int M);
  void ensureActs(int B, int T);
  void ensureCache();
  bool decodeWithStepGraph(int32_t token, float* logitsOut);
  struct StepRecording;
  StepRecording* stepRecording(const PathEntry* path, int32_t token);
  void stepsReplayed(const StepRecording& rec, const PathEntry* path, int n);
  StepRecording recordDecodeStep(const PathEntry* path, bool fused, int form);
  int queueStep(const PathEntry* path, bool fused, int form, int32_t* greedyIds = nullptr);
  int queueGreedyRun(const PathEntry* path, int form, int32_t* greedyIds, int steps);
  int runSpeculative(const PathEntry* path, const int32_t* cachedIds, int32_t* greedyIds, int n);
  void recordGreedyRun(StepRecording& rec, const PathEntry* path, int32_t* ids);
  double stepMicros(StepRecording& rec, int32_t token);
  void recordOpSteps(const PathEntry* path);
  Ops::DecodeStepArgs fusedStepArgs(const PathEntry* path, int form);

  Ops& ops_;
  ModelConfig cfg_;
  std::vector<ParamInfo> params_;
  std::map<std::string, size_t> paramIndex_;
  int64_t numParams_ = 0;
  Tensor paramBuf_, gradBuf_, mBuf_, vBuf_;
  int adamStep_ = 0;
  std::vector<Layer> layers_;
  const ParamInfo *wte_ = nullptr, *wpe_ = nullptr, *lnfW_ = nullptr, *lnfB_ = nullptr;
  PathSet* paths_ = nullptr;
  std::string lastLinearPath_ = "f32";
  bool pathInTraining_ = true, pathInInference_ = true, forceF32_ = false;
  std::unique_ptr<Acts> acts_;
  // KV cache: per layer the fused qkv rows of every cached position, [blockSize, 3C].
  std::vector<Tensor> kvCache_;
  std::unique_ptr<Acts> inferActs_;
  int cachePos_ = 0;
  // Step graphs: one recording per path (nullptr: f32), the step's [token, pos] on the device
  // and the new position's fused qkv row.
  struct StepRecording {
    std::unique_ptr<Ops::StepGraph> graph;
    int fusedBlocks = 0;  // 0: the op-by-op kernels were recorded
    int form = 0;         // the fused form asked for (Ops::DecodeStepArgs::form)
    // decodeGreedy's kGreedyRunSteps [step, pick] pairs, recorded on first use (null: not yet,
    // or recording failed).
    std::unique_ptr<Ops::StepGraph> greedyRun;
    bool persistentRun = false;  // greedyRun is one launch of kGreedyRunSteps steps
  };
  std::map<const PathEntry*, StepRecording> stepGraphs_;
  std::shared_ptr<Buffer> stepIds_;
  std::shared_ptr<Buffer> greedyIds_;  // decodeGreedy's picks, by position [blockSize]
  Tensor stepQkv_;
  bool stepGraphsOn_ = true, stepGraphsBroken_ = false, usedStepGraph_ = false;
  bool greedyRunGraphs_ = true, greedyRunsBroken_ = false;
  bool persistentGreedyRuns_ = true, usedPersistentRun_ = false;
  int speculativeLanes_ = kDefaultSpeculativeLanes, lastSpecTokens_ = 0, lastSpecSteps_ = 0,
      lastSpecLanes_ = 0;
  std::shared_ptr<Buffer> specHistory_, specStats_;  // [blockSize] tokens; the run's counters
  FusedSteps fusedSteps_ = FusedSteps::Auto;
  // Auto's timed choice per path: 0 the op kernels, f > 0 fused form f.
  std::map<const PathEntry*, int> stepForm_;
  bool fusedStepsBroken_ = false;
  int fusedClusterBlocks_ = 0, fusedForm_ = 0, usedFusedStep_ = 0, usedFusedForm_ = 0;
};

}  // namespace ptllm
