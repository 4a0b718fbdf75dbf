// Stopping torch.profiler without holding up the training thread (agent/offstop.py).
//
// torch's _disable_profiler does Kineto's whole post-processing (CUPTI buffers -> activities,
// CPU ops -> events) holding the GIL, on the thread that started the profiler: its profiler
// state lives in that thread's ThreadLocalDebugInfo. Here the training thread only takes that
// state out of its thread-local slot and removes its own RecordFunction callback (microseconds):
// from then on it records nothing. Another thread puts the state into its own slot and calls
// torch's own disableProfiler() + ProfilerResult::save() there, through ctypes, which releases
// the GIL: the job runs on meanwhile. This is what Kineto's on-demand mode (dynolog) does, from
// its own thread, for a profiler it started itself.
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <dlfcn.h>

#include <cstdio>
#include <exception>
#include <memory>
#include <string>

namespace {
using Held = std::shared_ptr<c10::DebugInfoBase>;

void say(char* buf, size_t n, const char* what) {
  if (buf && n) {
    std::snprintf(buf, n, "%s", what);
  }
}
// CUPTI activity kinds Kineto enables for a CUDA capture (cupti_activity.h): MEMCPY, MEMSET,
// KERNEL, DRIVER, RUNTIME, CONCURRENT_KERNEL.
const int kActivityKinds[] = {1, 2, 3, 4, 5, 10};

// Stop CUPTI recording new CUDA work now. disableProfiler() stops it only after turning the
// recorded ops into events (a few hundred ms), while the job's next steps pay CUPTI's cost per
// CUDA call; records of work already done stay in CUPTI's buffers for Kineto's flush (Kineto
// itself disables before it flushes). Returns how many kinds were disabled (0: no libcupti).
int stop_cupti_recording() {
  const char* names[] = {"libcupti.so.13", "libcupti.so.12", "libcupti.so"};
  for (const char* name : names) {
    void* lib = dlopen(name, RTLD_NOW | RTLD_NOLOAD);  // only the copy the process already runs
    if (!lib) {
      continue;
    }
    using Disable = int (*)(int);
    auto disable = reinterpret_cast<Disable>(dlsym(lib, "cuptiActivityDisable"));
    int n = 0;
    if (disable) {
      for (int kind : kActivityKinds) {
        n += disable(kind) == 0;
      }
    }
    dlclose(lib);
    return n;
  }
  return 0;
}
}  // namespace

extern "C" {

// On the thread that started the profiler: take its state out and stop recording on this
// thread. Returns a handle for aiprof_finish, or NULL (err says why; nothing was changed).
void* aiprof_detach(char* err, size_t n) {
  try {
    if (!c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE)) {
      say(err, n, "no profiler runs on this thread");
      return nullptr;
    }
    // throws, changing nothing, when another debug info was pushed above the profiler's
    Held state = c10::ThreadLocalDebugInfo::_pop(c10::DebugInfoKind::PROFILER_STATE);
    static_cast<torch::profiler::impl::ProfilerStateBase*>(state.get())->removeCallback();
    return new Held(std::move(state));
  } catch (const std::exception& e) {
    say(err, n, e.what());
  } catch (...) {
    say(err, n, "unknown C++ exception");
  }
  return nullptr;
}

// On any other thread: finish the detached profiler (Kineto's post-processing) and write its
// Chrome trace to path (nothing written for an empty path). With cupti_first, CUPTI stops
// recording before the post-processing starts. Frees the handle. 0 when done.
int aiprof_finish(void* handle, const char* path, int cupti_first, char* err, size_t n) {
  Held* held = static_cast<Held*>(handle);
  if (!held) {
    say(err, n, "no handle");
    return -1;
  }
  try {
    c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE, *held);
    delete held;
    held = nullptr;
    if (cupti_first) {
      stop_cupti_recording();
    }
    auto result = torch::autograd::profiler::disableProfiler();
    if (result && path && *path) {
      result->save(path);
    }
    return 0;
  } catch (const std::exception& e) {
    say(err, n, e.what());
  } catch (...) {
    say(err, n, "unknown C++ exception");
  }
  delete held;
  return -1;
}

}  // extern "C"
