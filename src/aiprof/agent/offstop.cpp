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
// Chrome trace to path (nothing written for an empty path). Frees the handle. 0 when done.
int aiprof_finish(void* handle, const char* path, char* err, size_t n) {
  Held* held = static_cast<Held*>(handle);
  if (!held) {
    say(err, n, "no handle");
    return -1;
  }
  try {
    c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE, *held);
    delete held;
    held = nullptr;
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
