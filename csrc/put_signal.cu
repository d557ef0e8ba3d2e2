// mxcomm: NVSHMEM put-with-signal transfer kernels for peers WITHOUT a peer pointer (other nodes).
//
// Built to a CUBIN (nvcc -rdc=true -c, then nvcc -dlink -cubin against libnvshmem_device) by
// mxcomm/transport/cubin.py, loaded through cuda.core, NVSHMEM device state set with
// nvshmem.core.library_init, launched by mxcomm/transport/put_signal.py.
//
// Protocol (one call of a transfer, all on one CUDA stream):
//   sender:   a previous kernel wrote the bytes for each destination into a local symmetric
//             STAGING buffer; mx_put_signal copies each entry's bytes into the destination's
//             receive buffer (a symmetric address, same on every PE) at the entry's byte offset and
//             then adds 1 to the destination's signal word with NVSHMEM_SIGNAL_ADD, once per
//             (entry, chunk): a call with n entries for PE p split into C chunks adds n*C to p's word.
//             Without a signal word (sig == nullptr) the pieces are plain non-blocking puts: a quiet
//             and one signal of the caller's say they arrived.
//   receiver: mx_wait_signals waits, bounded by %globaltimer, until each listed signal word is
//             >= epoch * per_epoch; signal words only grow (no reset, no reset race).
// Error words: int64, (code << 32) | peer, atomicMax (mxcomm/transport/errors.py):
//   code 1 (TIMEOUT) peer = signal index waited for; code 2 (BAD_ENTRY) peer = destination PE of an
//   entry whose offsets/size/PE are out of range (that entry is neither put nor signalled).
#include <nvshmem.h>
#include <nvshmemx.h>
#include <cstdint>

#define MX_TIMEOUT_CODE 1ULL
#define MX_BAD_ENTRY_CODE 2ULL
#define MX_ERR_CODE_SHIFT 32
#define MX_CHUNK_ALIGN 16

__device__ __forceinline__ uint64_t mx_globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void mx_record_error(int64_t* err, unsigned long long code, unsigned int peer) {
  atomicMax(reinterpret_cast<unsigned long long*>(err), (code << MX_ERR_CODE_SHIFT) | peer);
}

// Grid (any number of blocks), any block size (all threads of a block call the _block put together).
// Entry i: nbytes[i] bytes from src + src_off[i] (local) to dst + dst_off[i] on PE pes[i], in
// `chunks` pieces of ceil(n / chunks) bytes rounded up to 16. The n_entries * chunks pieces are
// dealt to the blocks in turn (piece b = i * chunks + c goes to block b % gridDim.x), so the grid
// bounds the SMs the copies occupy. With sig, every piece adds 1 to *sig on pes[i] after its bytes
// (an empty piece signals without a put); without (nullptr), a piece is a plain put.
//   dst, sig: symmetric addresses (this PE's view); src: local, symmetric (IB needs registered memory).
//   dst_bytes / src_bytes: capacity of dst / src from the given base (bounds check).
extern "C" __global__ void mx_put_signal(uint8_t* dst, uint64_t dst_bytes, const uint8_t* src, uint64_t src_bytes,
                                         const int64_t* dst_off, const int64_t* src_off, const int64_t* nbytes,
                                         const int32_t* pes, int n_entries, int chunks, uint64_t* sig, int n_pes,
                                         int64_t* err) {
  const int64_t pieces = (int64_t)n_entries * chunks;
  for (int64_t b = blockIdx.x; b < pieces; b += gridDim.x) {  // block-uniform: every thread takes each piece
    const int i = (int)(b / chunks);
    const int c = (int)(b - (int64_t)i * chunks);
    const int64_t n = nbytes[i], d = dst_off[i], s = src_off[i];
    const int pe = pes[i];
    const bool ok = n >= 0 && d >= 0 && s >= 0 && pe >= 0 && pe < n_pes && (uint64_t)d <= dst_bytes &&
                    (uint64_t)n <= dst_bytes - (uint64_t)d && (uint64_t)s <= src_bytes &&
                    (uint64_t)n <= src_bytes - (uint64_t)s;
    if (!ok) {
      if (threadIdx.x == 0 && c == 0) mx_record_error(err, MX_BAD_ENTRY_CODE, pe < 0 ? 0u : (unsigned int)pe);
      continue;
    }
    const int64_t per = ((n + chunks - 1) / chunks + MX_CHUNK_ALIGN - 1) / MX_CHUNK_ALIGN * MX_CHUNK_ALIGN;
    const int64_t lo = min(n, (int64_t)c * per);
    const int64_t hi = min(n, lo + per);
    if (hi > lo) {
      if (sig != nullptr) {
        nvshmemx_putmem_signal_nbi_block(dst + d + lo, src + s + lo, (size_t)(hi - lo), sig, 1, NVSHMEM_SIGNAL_ADD,
                                         pe);
      } else {
        nvshmemx_putmem_nbi_block(dst + d + lo, src + s + lo, (size_t)(hi - lo), pe);
      }
    } else if (sig != nullptr && threadIdx.x == 0) {
      nvshmemx_signal_op(sig, 1, NVSHMEM_SIGNAL_ADD, pe);
    }
  }
}

// One thread per listed signal: wait until signals[idx[k]] >= (*epoch) * per_epoch, or until
// timeout_ns passed since the thread started (then atomicMax (1 << 32) | idx[k] into *err), or until
// *err is non-zero (another wait failed first: give up without recording, so that a call whose peer
// is gone fails after one timeout, not one per wait; as mxcomm's Triton waits do).
// After success nvshmem_uint64_test orders the data delivered before the signal before later reads.
//   signals: this PE's symmetric signal words (uint64/int64), n_signals of them; idx: int32 [n]
//   (an index outside [0, n_signals) records (2 << 32) | index and is not read); epoch: int64 scalar.
extern "C" __global__ void mx_wait_signals(uint64_t* signals, int n_signals, const int32_t* idx, int n,
                                           const int64_t* epoch, int64_t per_epoch, int64_t timeout_ns,
                                           int64_t* err) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= n) return;
  const int j = idx[k];
  if (j < 0 || j >= n_signals) {
    mx_record_error(err, MX_BAD_ENTRY_CODE, j < 0 ? 0u : (unsigned int)j);
    return;
  }
  const uint64_t expected = (uint64_t)(*epoch) * (uint64_t)per_epoch;
  uint64_t* w = signals + j;
  const uint64_t deadline = mx_globaltimer() + (uint64_t)timeout_ns;
  const volatile int64_t* failed = err;
  while (nvshmem_signal_fetch(w) < expected) {
    if (*failed != 0) return;  // (the data is not read after a failed call)
    if (mx_globaltimer() > deadline) {
      if (nvshmem_signal_fetch(w) < expected) {
        mx_record_error(err, MX_TIMEOUT_CODE, (unsigned int)j);
        return;
      }
      break;
    }
  }
  nvshmem_uint64_test(w, NVSHMEM_CMP_GE, expected);
}

// Completes every put this PE issued (the staging buffer may be rewritten after it). Grid (1), block (1).
extern "C" __global__ void mx_quiet() { nvshmem_quiet(); }
