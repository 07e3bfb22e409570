/* OpenBLAS on the training step's GEMM shapes, the peer of `ptllm bench gemm`: the same four
 * linear layers of a block at the same token count, forward (X W), dX = dY W^T and
 * dW = X^T dY, each timed warm (the same operands back to back) and cold (rotating over copies,
 * >= 256 MiB a shape), median of --iters calls after 3 warm-ups. Prints
 * `peer=openblas mode=gemm layer=... op=... warm_gflops=... cold_gflops=...` lines.
 *   gcc -O2 bench/gemm_peer.c -lopenblas -o /tmp/gemm_peer
 *   OPENBLAS_NUM_THREADS=2 /tmp/gemm_peer --tokens 4096 --n-embd 256 --iters 10 */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}
static int cmp(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}
static float* filled(size_t n, unsigned* seed) {
  float* p = malloc(n * sizeof(float));
  if (!p) {
    fprintf(stderr, "gemm_peer: out of memory (%zu floats)\n", n);
    exit(1);
  }
  for (size_t i = 0; i < n; ++i) p[i] = (float)rand_r(seed) / RAND_MAX * 2.0f - 1.0f;
  return p;
}

typedef struct {
  float *in, *w, *dy, *out, *dx, *dw;
} Set;

/* op 0: out = in w; 1: dx = dy w^T; 2: dw = in^T dy */
static void run(int op, Set* s, int T, int K, int N) {
  if (op == 0)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, N, K, 1, s->in, K, s->w, N, 0, s->out,
                N);
  else if (op == 1)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, K, N, 1, s->dy, N, s->w, N, 0, s->dx,
                K);
  else
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, K, N, T, 1, s->in, K, s->dy, N, 0, s->dw,
                N);
}

static double median_ms(int op, Set* sets, int copies, int T, int K, int N, int iters) {
  double* t = malloc(sizeof(double) * iters);
  for (int i = 0; i < 3; ++i) run(op, &sets[i % copies], T, K, N);
  for (int i = 0; i < iters; ++i) {
    const double t0 = now();
    run(op, &sets[copies == 1 ? 0 : (i + 1) % copies], T, K, N);
    t[i] = (now() - t0) * 1e3;
  }
  qsort(t, iters, sizeof(double), cmp);
  const double m = t[iters / 2];
  free(t);
  return m;
}

int main(int argc, char** argv) {
  int T = 4096, C = 256, iters = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--tokens"))
      T = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--n-embd"))
      C = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--iters"))
      iters = atoi(argv[i + 1]);
    else {
      fprintf(stderr, "gemm_peer: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (T < 1 || C < 1 || iters < 1) {
    fprintf(stderr, "gemm_peer: --tokens, --n-embd and --iters must be >= 1\n");
    return 2;
  }
  const char* names[4] = {"attn", "proj", "fc", "fcproj"};
  const int Ks[4] = {C, C, C, 4 * C}, Ns[4] = {3 * C, C, 4 * C, C};
  const char* ops[3] = {"fwd", "abt", "atb"};
  unsigned seed = 7;
  for (int l = 0; l < 4; ++l) {
    const int K = Ks[l], N = Ns[l];
    const size_t setBytes =
        sizeof(float) * (2 * (size_t)T * K + 2 * (size_t)T * N + 2 * (size_t)K * N);
    int copies = (int)(((size_t)256 << 20) / setBytes + 1);
    if (copies < 2) copies = 2;
    Set* sets = calloc(copies, sizeof(Set));
    for (int c = 0; c < copies; ++c) {
      sets[c].in = filled((size_t)T * K, &seed);
      sets[c].w = filled((size_t)K * N, &seed);
      sets[c].dy = filled((size_t)T * N, &seed);
      sets[c].out = filled((size_t)T * N, &seed);
      sets[c].dx = filled((size_t)T * K, &seed);
      sets[c].dw = filled((size_t)K * N, &seed);
    }
    const double flop = 2.0 * T * K * N;
    for (int op = 0; op < 3; ++op) {
      const double warm = median_ms(op, sets, 1, T, K, N, iters);
      const double cold = median_ms(op, sets, copies, T, K, N, iters);
      printf(
          "peer=openblas mode=gemm layer=%s op=%s M=%d K=%d N=%d threads=%d warm_ms=%.3f "
          "cold_ms=%.3f warm_gflops=%.1f cold_gflops=%.1f\n",
          names[l], ops[op], T, K, N, openblas_get_num_threads(), warm, cold, flop / warm / 1e6,
          flop / cold / 1e6);
    }
    for (int c = 0; c < copies; ++c) {
      free(sets[c].in), free(sets[c].w), free(sets[c].dy);
      free(sets[c].out), free(sets[c].dx), free(sets[c].dw);
    }
    free(sets);
  }
  return 0;
}
