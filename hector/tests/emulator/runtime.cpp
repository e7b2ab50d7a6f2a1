// The emulator's scheduler (see shim.hpp): built once per process into a shared library that every emulated kernel
// module links against, so each module compiles only its kernels and this small header's inline parts.
//
// Every CUDA thread of a block is a fiber on one OS thread; blocks run one after another. A fiber runs until it
// reaches a barrier (__syncthreads, __syncwarp, a shuffle, an mma), where it yields to the scheduler. On x86-64 a
// fiber switch saves the callee-saved registers and swaps stacks (a few instructions); elsewhere it is ucontext's
// swapcontext, which also saves the signal mask with a system call on every switch (~10x slower overall;
// -DHECTOR_EMU_UCONTEXT selects it on x86-64 too).
#include <cstdint>
#include <cstdio>
#include <vector>

#include "shim.hpp"

#if defined(__x86_64__) && !defined(HECTOR_EMU_UCONTEXT)
#define HECTOR_EMU_ASM_SWITCH 1
#else
#define HECTOR_EMU_ASM_SWITCH 0
#include <ucontext.h>
#endif

hector_dim3 threadIdx, blockIdx, blockDim, gridDim;

#if HECTOR_EMU_ASM_SWITCH
// hector_emu_switch(save, load): push the callee-saved registers, store the stack pointer in *save, load `load`
// as the stack pointer, pop the registers saved there and return into that context.
extern "C" void hector_emu_switch(void** save, void* load);
asm(R"(
  .text
  .p2align 4
  .globl hector_emu_switch
  .hidden hector_emu_switch
  .type hector_emu_switch, @function
hector_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size hector_emu_switch, .-hector_emu_switch
)");
#endif

namespace hector_emu {
namespace {

struct fiber {
#if HECTOR_EMU_ASM_SWITCH
  void* sp = nullptr;  // saved stack pointer while suspended
#else
  ucontext_t context;
#endif
  bool done = false;
  hector_dim3 tid;
};

std::vector<fiber> fibers;
std::vector<std::vector<char>> stacks;
fiber* current = nullptr;
void (*stub)(void**) = nullptr;
void** stub_args = nullptr;
unsigned threads_in_block = 0;
std::vector<unsigned char> smem;
long long barrier_waits = 0;
constexpr std::size_t stack_bytes = 256 * 1024;

#if HECTOR_EMU_ASM_SWITCH
void* scheduler_sp = nullptr;

[[noreturn]] void fiber_entry() {
  stub(stub_args);
  current->done = true;
  void* unused;
  hector_emu_switch(&unused, scheduler_sp);
  __builtin_unreachable();
}

void start(fiber& f, char* stack) {
  auto top = reinterpret_cast<std::uintptr_t>(stack + stack_bytes) & ~std::uintptr_t{15};
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                                // fiber_entry's return address: it never returns
  *--sp = reinterpret_cast<void*>(&fiber_entry);  // where hector_emu_switch's ret goes
  for (int r = 0; r < 6; ++r) *--sp = nullptr;    // rbp, rbx, r12-r15
  f.sp = sp;                                      // at fiber_entry, rsp = top - 8: aligned as after a call
}
void resume(fiber& f) { hector_emu_switch(&scheduler_sp, f.sp); }
void suspend() { hector_emu_switch(&current->sp, scheduler_sp); }
#else
ucontext_t scheduler;

void fiber_entry() {
  stub(stub_args);
  current->done = true;
  // uc_link returns to the scheduler
}

void start(fiber& f, char* stack) {
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = stack;
  f.context.uc_stack.ss_size = stack_bytes;
  f.context.uc_link = &scheduler;
  makecontext(&f.context, fiber_entry, 0);
}
void resume(fiber& f) { swapcontext(&scheduler, &f.context); }
void suspend() { swapcontext(&current->context, &scheduler); }
#endif

// __syncthreads: all threads of the block
unsigned block_arrived = 0;
unsigned long long block_generation = 0;

// warp barriers, one per (warp, mask) in use at a time
struct warp_barrier {
  unsigned mask = 0, arrived = 0;
  unsigned long long generation = 0;
};
std::vector<std::vector<warp_barrier>> warp_barriers;

// shuffle exchange: one 8-byte slot per lane of each warp; tensor-core operands of each warp
std::vector<std::vector<std::uint64_t>> exchange;
std::vector<std::vector<float>> wmma_a, wmma_b;

}  // namespace

void sync_block() {
  const unsigned long long gen = block_generation;
  if (++block_arrived == threads_in_block) {
    block_arrived = 0;
    ++block_generation;
    return;
  }
  while (block_generation == gen) suspend();
}

void sync_warp(unsigned mask) {
  const unsigned lane = lane_id();
  if (!(mask & (1u << lane))) {
    std::fprintf(stderr, "emulator: lane %u calls a warp barrier with mask %08x that excludes it\n", lane, mask);
    std::abort();
  }
  auto& list = warp_barriers[warp_id()];
  warp_barrier* b = nullptr;
  for (auto& entry : list)
    if (entry.mask == mask) b = &entry;
  if (b == nullptr) {
    list.push_back(warp_barrier{mask, 0, 0});
    b = &list.back();
  }
  const unsigned long long gen = b->generation;
  b->arrived |= 1u << lane;
  if (b->arrived == mask) {
    b->arrived = 0;
    ++b->generation;
    return;
  }
  // the vector may grow while we wait: look the barrier up again after each yield
  for (;;) {
    suspend();
    for (auto& entry : warp_barriers[warp_id()])
      if (entry.mask == mask && entry.generation != gen) return;
  }
}

std::uint64_t* warp_exchange() { return exchange[warp_id()].data(); }
float* warp_wmma_a() { return wmma_a[warp_id()].data(); }
float* warp_wmma_b() { return wmma_b[warp_id()].data(); }
unsigned char* dynamic_smem() { return smem.data(); }

int launch(void (*kernel_stub)(void**), unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
           unsigned smem_bytes, void** args) {
  const unsigned n = bx * by * bz;
  if (n == 0 || n > 1024) return 1;
  stub = kernel_stub;
  stub_args = args;
  threads_in_block = n;
  gridDim = {gx, gy, gz};
  blockDim = {bx, by, bz};
  smem.assign(smem_bytes + 16, 0xA5);  // poison: generated code must not read shared memory it did not write
  if (stacks.size() < n) stacks.resize(n, std::vector<char>(stack_bytes));
  const unsigned warps = (n + 31) / 32;
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        blockIdx = {x, y, z};
        fibers.assign(n, fiber{});
        warp_barriers.assign(warps, {});
        exchange.assign(warps, std::vector<std::uint64_t>(32, 0));
        wmma_a.assign(warps, std::vector<float>(256, 0.f));
        wmma_b.assign(warps, std::vector<float>(256, 0.f));
        block_arrived = 0;
        for (unsigned t = 0; t < n; ++t) {
          fiber& f = fibers[t];
          f.tid = {t % bx, (t / bx) % by, t / (bx * by)};
          start(f, stacks[t].data());
        }
        for (;;) {
          bool any = false;
          for (auto& f : fibers) {
            if (f.done) continue;
            any = true;
            current = &f;
            threadIdx = f.tid;
            resume(f);
          }
          if (!any) break;
          ++barrier_waits;
          if (barrier_waits > (1ll << 40)) return 2;
        }
        // a thread that finished while others wait at a block barrier is a deadlock on a GPU
        if (block_arrived != 0) {
          std::fprintf(stderr, "emulator: %u threads left waiting at __syncthreads\n", block_arrived);
          return 3;
        }
      }
  return 0;
}

}  // namespace hector_emu

extern "C" int hector_emu_launch(void (*kernel_stub)(void**), unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                 unsigned by, unsigned bz, unsigned smem, void** args) {
  return hector_emu::launch(kernel_stub, gx, gy, gz, bx, by, bz, smem, args);
}
