/*
 * aiprof injection shim: loaded into a running CPython 3.10+ (pyinjector or gdb calls dlopen in
 * the target). Its constructor asks the interpreter, through Py_AddPendingCall, to run the
 * Python file that sits next to this library (same path, ".py" instead of ".so") on the main
 * thread, with the GIL held, between two bytecodes. Nothing runs in the injecting thread.
 *
 * No Python.h: the four functions used are part of the stable ABI, declared here, so one
 * build works for every CPython version and needs only a C compiler.
 * Build: cc -shared -fPIC -O2 -o shim.so shim.c   (aiprof builds and caches it on first attach)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

extern int Py_IsInitialized(void);
extern int Py_AddPendingCall(int (*func)(void *), void *arg);
extern int PyRun_SimpleString(const char *command);

static char script_path[4096];

static int aiprof_run_script(void *arg) {
    (void)arg;
    /* the CLI guarantees the path has no quote or backslash */
    char cmd[4096 + 256];
    snprintf(cmd, sizeof cmd,
             "exec(compile(open('%s').read(), '%s', 'exec'), {'__name__': '__aiprof_attach__'})",
             script_path, script_path);
    PyRun_SimpleString(cmd);
    return 0;
}

__attribute__((constructor)) static void aiprof_shim_init(void) {
    Dl_info info;
    size_t n;
    if (!Py_IsInitialized()) return;
    if (!dladdr((void *)&aiprof_shim_init, &info) || !info.dli_fname) return;
    n = strlen(info.dli_fname);
    if (n < 4 || n + 1 > sizeof script_path || strcmp(info.dli_fname + n - 3, ".so") != 0) return;
    memcpy(script_path, info.dli_fname, n - 3);
    memcpy(script_path + n - 3, ".py", 4);
    Py_AddPendingCall(aiprof_run_script, NULL);
}
