/*
 * aiprof PM sampler: CUPTI's PM sampling API (CUDA 12.6+) behind a small C interface for ctypes.
 *
 * Built once with the system C++ compiler (cupti_profiler_host.h includes <string>, so this C
 * is compiled as C++ with C linkage) against the CUPTI headers (agent/pmsampling.py) and cached. libcupti is not linked: it is dlopen()ed by the path the caller gives, which is the
 * copy already loaded in the process (torch's, which Kineto uses), so the process holds a
 * single CUPTI.
 *
 * One device per process. The GPU writes samples into a hardware buffer; a pthread of ours
 * (no Python, no GIL) decodes them every decode period into a counter data image, evaluates
 * each completed sample to metric values and appends (t0, t1, values) to a bounded row buffer
 * that Python drains after the capture. The PM sampling object is never disabled:
 * cuptiPmSamplingDisable tears down CUPTI state that Kineto's activity tracing still uses, so
 * the object is kept for the life of the process and reused by later captures.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cupti_result.h>
#include <cupti_pmsampling.h>
#include <cupti_profiler_host.h>
#include <cupti_profiler_target.h>
#include <cupti_target.h>

extern "C" {

#define APS_MAX_METRICS 32
#define APS_ERR 512

typedef CUptiResult (*fn_t)(void *);

/* a CUPTI params struct: zeroed, with its size set (pPriv must be NULL) */
#define PARAMS(type, name)     \
    type name;                 \
    memset(&name, 0, sizeof name); \
    name.structSize = type##_STRUCT_SIZE

static void *g_lib;
static CUptiResult (*p_GetResultString)(CUptiResult, const char **);
static CUptiResult (*p_GetTimestamp)(uint64_t *);
static fn_t p_ProfilerInitialize, p_DeviceGetChipName, p_HostInitialize, p_HostDeinitialize,
    p_HostGetBaseMetrics, p_HostGetSubMetrics, p_HostConfigAddMetrics, p_HostGetConfigImageSize,
    p_HostGetConfigImage, p_HostGetNumOfPasses, p_HostEvaluate, p_PmEnable, p_PmSetConfig,
    p_PmStart, p_PmStop, p_PmDecode, p_PmGetAvailability, p_PmGetCounterDataSize,
    p_PmCounterDataInit, p_PmGetCounterDataInfo, p_PmGetSampleInfo;

static char g_err[APS_ERR];

/* the configured session */
static int g_dev = -1;
static CUpti_PmSampling_Object *g_obj;     /* kept for the process's life (see top) */
static CUpti_Profiler_Host_Object *g_host;
static uint8_t *g_avail, *g_config, *g_cdi, *g_cdi_clean;
static size_t g_avail_size, g_config_size, g_cdi_size;
static char g_chip[64];
static char *g_names_buf;
static const char *g_names[APS_MAX_METRICS];
static int g_nm;

/* the row buffer: written by the decode thread, read after it stopped */
typedef struct {
    uint64_t t0, t1;
    float v[APS_MAX_METRICS];
} aps_row;
static aps_row *g_rows;
static size_t g_cap, g_n;
static uint64_t g_dropped, g_overflows, g_decode_errors, g_decodes, g_full_image;
static double g_decode_s, g_eval_s;
static int g_last_error;

/* a clock pair taken right after each decode: the rows decoded by then were converted to the
 * timestamp domain CUPTI had at that moment (a profiler's timestamp callback can change it) */
typedef struct {
    uint64_t row_end, cupti_ns;
    int64_t unix_ns;
} aps_batch;
#define APS_MAX_BATCHES 16384
static aps_batch g_batches[APS_MAX_BATCHES];
static size_t g_nb;

static void note_batch(void) {
    if (g_nb >= APS_MAX_BATCHES || !p_GetTimestamp) return;
    if (g_nb > 0 && g_batches[g_nb - 1].row_end == g_n) return; /* nothing new decoded */
    struct timespec a, b;
    uint64_t t;
    clock_gettime(CLOCK_REALTIME, &a);
    if (p_GetTimestamp(&t) != CUPTI_SUCCESS) return;
    clock_gettime(CLOCK_REALTIME, &b);
    int64_t ua = (int64_t)a.tv_sec * 1000000000LL + a.tv_nsec;
    int64_t ub = (int64_t)b.tv_sec * 1000000000LL + b.tv_nsec;
    g_batches[g_nb].row_end = g_n;
    g_batches[g_nb].cupti_ns = t;
    g_batches[g_nb].unix_ns = ua + (ub - ua) / 2;
    g_nb++;
}

size_t aps_batch_count(void) { return g_nb; }

void aps_copy_batches(uint64_t *row_end, uint64_t *cupti_ns, int64_t *unix_ns) {
    for (size_t i = 0; i < g_nb; i++) {
        row_end[i] = g_batches[i].row_end;
        cupti_ns[i] = g_batches[i].cupti_ns;
        unix_ns[i] = g_batches[i].unix_ns;
    }
}

static pthread_t g_thread;
static volatile int g_stop_req, g_running;
static unsigned g_period_us;

static void set_err(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
}

static const char *res_str(CUptiResult r) {
    const char *s = NULL;
    if (p_GetResultString && p_GetResultString(r, &s) == CUPTI_SUCCESS && s) return s;
    return "unknown CUPTI error";
}

#define CALL(fn, p, what)                                                           \
    do {                                                                            \
        CUptiResult r_ = (fn)((void *)(p));                                         \
        if (r_ != CUPTI_SUCCESS) {                                                  \
            g_last_error = (int)r_;                                                 \
            set_err("%s: %s (CUPTI error %d)", what, res_str(r_), (int)r_);         \
            return -(int)r_ - 1000;                                                 \
        }                                                                           \
    } while (0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

const char *aps_error(void) { return g_err; }
int aps_last_cupti_error(void) { return g_last_error; }

/* dlopen libcupti (a path, or a soname already loaded) and resolve every entry point. */
static int g_ready; /* every symbol resolved and the profiler initialised */

int aps_open(const char *libpath) {
    if (g_ready) return 0;
    if (!g_lib) g_lib = dlopen(libpath, RTLD_NOW | RTLD_GLOBAL);
    if (!g_lib) {
        set_err("dlopen %s: %s", libpath, dlerror());
        return -1;
    }
#define SYM(var, name)                                                  \
    do {                                                                \
        *(void **)&var = dlsym(g_lib, name);                            \
        if (!var) {                                                     \
            set_err("%s not in %s (CUPTI older than 12.6?)", name, libpath); \
            return -2;                                                  \
        }                                                               \
    } while (0)
    SYM(p_GetResultString, "cuptiGetResultString");
    SYM(p_GetTimestamp, "cuptiGetTimestamp");
    SYM(p_ProfilerInitialize, "cuptiProfilerInitialize");
    SYM(p_DeviceGetChipName, "cuptiDeviceGetChipName");
    SYM(p_HostInitialize, "cuptiProfilerHostInitialize");
    SYM(p_HostDeinitialize, "cuptiProfilerHostDeinitialize");
    SYM(p_HostGetBaseMetrics, "cuptiProfilerHostGetBaseMetrics");
    SYM(p_HostGetSubMetrics, "cuptiProfilerHostGetSubMetrics");
    SYM(p_HostConfigAddMetrics, "cuptiProfilerHostConfigAddMetrics");
    SYM(p_HostGetConfigImageSize, "cuptiProfilerHostGetConfigImageSize");
    SYM(p_HostGetConfigImage, "cuptiProfilerHostGetConfigImage");
    SYM(p_HostGetNumOfPasses, "cuptiProfilerHostGetNumOfPasses");
    SYM(p_HostEvaluate, "cuptiProfilerHostEvaluateToGpuValues");
    SYM(p_PmEnable, "cuptiPmSamplingEnable");
    SYM(p_PmSetConfig, "cuptiPmSamplingSetConfig");
    SYM(p_PmStart, "cuptiPmSamplingStart");
    SYM(p_PmStop, "cuptiPmSamplingStop");
    SYM(p_PmDecode, "cuptiPmSamplingDecodeData");
    SYM(p_PmGetAvailability, "cuptiPmSamplingGetCounterAvailability");
    SYM(p_PmGetCounterDataSize, "cuptiPmSamplingGetCounterDataSize");
    SYM(p_PmCounterDataInit, "cuptiPmSamplingCounterDataImageInitialize");
    SYM(p_PmGetCounterDataInfo, "cuptiPmSamplingGetCounterDataInfo");
    SYM(p_PmGetSampleInfo, "cuptiPmSamplingCounterDataGetSampleInfo");
#undef SYM
    PARAMS(CUpti_Profiler_Initialize_Params, ip);
    CALL(p_ProfilerInitialize, &ip, "cuptiProfilerInitialize");
    g_ready = 1;
    return 0;
}

/* One (CUPTI timestamp, CLOCK_REALTIME) pair: the read with the narrowest host bracket of n. */
int aps_clock_pair(int n, uint64_t *cupti_ns, int64_t *unix_ns, int64_t *bracket_ns) {
    int64_t best = INT64_MAX;
    if (!p_GetTimestamp) return -1;
    for (int i = 0; i < n; i++) {
        struct timespec a, b;
        uint64_t t;
        clock_gettime(CLOCK_REALTIME, &a);
        if (p_GetTimestamp(&t) != CUPTI_SUCCESS) return -2;
        clock_gettime(CLOCK_REALTIME, &b);
        int64_t ua = (int64_t)a.tv_sec * 1000000000LL + a.tv_nsec;
        int64_t ub = (int64_t)b.tv_sec * 1000000000LL + b.tv_nsec;
        if (ub - ua < best) {
            best = ub - ua;
            *cupti_ns = t;
            *unix_ns = ua + (ub - ua) / 2;
        }
    }
    *bracket_ns = best;
    return 0;
}

static int chip_and_availability(int dev) {
    PARAMS(CUpti_Device_GetChipName_Params, cp);
    cp.deviceIndex = (size_t)dev;
    CALL(p_DeviceGetChipName, &cp, "cuptiDeviceGetChipName");
    snprintf(g_chip, sizeof g_chip, "%s", cp.pChipName);
    if (g_avail && g_dev == dev) return 0;
    PARAMS(CUpti_PmSampling_GetCounterAvailability_Params, ap);
    ap.deviceIndex = (size_t)dev;
    CALL(p_PmGetAvailability, &ap, "cuptiPmSamplingGetCounterAvailability(size)");
    free(g_avail);
    g_avail = (uint8_t *)calloc(1, ap.counterAvailabilityImageSize);
    if (!g_avail) {
        set_err("out of memory");
        return -3;
    }
    g_avail_size = ap.counterAvailabilityImageSize;
    ap.pCounterAvailabilityImage = g_avail;
    CALL(p_PmGetAvailability, &ap, "cuptiPmSamplingGetCounterAvailability");
    return 0;
}

const char *aps_chip(void) { return g_chip; }

static int host_init(CUpti_Profiler_Host_Object **out) {
    PARAMS(CUpti_Profiler_Host_Initialize_Params, hp);
    hp.profilerType = CUPTI_PROFILER_TYPE_PM_SAMPLING;
    hp.pChipName = g_chip;
    hp.pCounterAvailabilityImage = g_avail;
    CALL(p_HostInitialize, &hp, "cuptiProfilerHostInitialize");
    *out = hp.pHostObject;
    return 0;
}

static void host_free(CUpti_Profiler_Host_Object *h) {
    if (!h) return;
    PARAMS(CUpti_Profiler_Host_Deinitialize_Params, dp);
    dp.pHostObject = h;
    p_HostDeinitialize(&dp);
}

/* Every base metric the PM sampler offers on this device, "type\tname\n" lines into out. */
int aps_list_metrics(int dev, char *out, size_t outlen) {
    if (!g_ready) {
        set_err("CUPTI not opened");
        return -9;
    }
    int rc = chip_and_availability(dev);
    if (rc) return rc;
    CUpti_Profiler_Host_Object *h = NULL;
    rc = host_init(&h);
    if (rc) return rc;
    size_t used = 0;
    out[0] = 0;
    for (int t = 0; t < 3; t++) {
        PARAMS(CUpti_Profiler_Host_GetBaseMetrics_Params, bp);
        bp.pHostObject = h;
        bp.metricType = (CUpti_MetricType)t;
        CUptiResult r = p_HostGetBaseMetrics(&bp);
        if (r != CUPTI_SUCCESS) continue;
        for (size_t i = 0; i < bp.numMetrics; i++) {
            int w = snprintf(out + used, outlen - used, "%d\t%s\n", t, bp.ppMetricNames[i]);
            if (w < 0 || (size_t)w >= outlen - used) {
                host_free(h);
                return 1; /* truncated */
            }
            used += (size_t)w;
        }
    }
    host_free(h);
    return 0;
}

/* Sub-metrics (rollups/suffixes) of one base metric, newline-separated into out. */
int aps_submetrics(const char *metric, int type, char *out, size_t outlen) {
    if (!g_ready) {
        set_err("CUPTI not opened");
        return -9;
    }
    CUpti_Profiler_Host_Object *h = NULL;
    int rc = host_init(&h);
    if (rc) return rc;
    PARAMS(CUpti_Profiler_Host_GetSubMetrics_Params, sp);
    sp.pHostObject = h;
    sp.metricType = (CUpti_MetricType)type;
    sp.pMetricName = metric;
    CUptiResult r = p_HostGetSubMetrics(&sp);
    size_t used = 0;
    out[0] = 0;
    if (r == CUPTI_SUCCESS) {
        for (size_t i = 0; i < sp.numOfSubmetrics; i++) {
            int w = snprintf(out + used, outlen - used, "%s\n", sp.ppSubMetrics[i]);
            if (w < 0 || (size_t)w >= outlen - used) break;
            used += (size_t)w;
        }
    } else {
        set_err("cuptiProfilerHostGetSubMetrics(%s): %s", metric, res_str(r));
    }
    host_free(h);
    return r == CUPTI_SUCCESS ? 0 : -1;
}

/* Number of passes a metric list needs (PM sampling takes 1 only); <0 on error. */
int aps_passes(int dev, const char **names, int n) {
    if (!g_ready) {
        set_err("CUPTI not opened");
        return -9;
    }
    int rc = chip_and_availability(dev);
    if (rc) return rc;
    CUpti_Profiler_Host_Object *h = NULL;
    rc = host_init(&h);
    if (rc) return rc;
    PARAMS(CUpti_Profiler_Host_ConfigAddMetrics_Params, mp);
    mp.pHostObject = h;
    mp.ppMetricNames = names;
    mp.numMetrics = (size_t)n;
    CUptiResult r = p_HostConfigAddMetrics(&mp);
    if (r != CUPTI_SUCCESS) {
        set_err("cuptiProfilerHostConfigAddMetrics: %s", res_str(r));
        host_free(h);
        return -(int)r - 1000;
    }
    PARAMS(CUpti_Profiler_Host_GetConfigImageSize_Params, sp);
    sp.pHostObject = h;
    r = p_HostGetConfigImageSize(&sp);
    int passes = -1;
    if (r == CUPTI_SUCCESS) {
        uint8_t *img = (uint8_t *)calloc(1, sp.configImageSize);
        PARAMS(CUpti_Profiler_Host_GetConfigImage_Params, gp);
        gp.pHostObject = h;
        gp.configImageSize = sp.configImageSize;
        gp.pConfigImage = img;
        if (img && p_HostGetConfigImage(&gp) == CUPTI_SUCCESS) {
            PARAMS(CUpti_Profiler_Host_GetNumOfPasses_Params, np);
            np.configImageSize = sp.configImageSize;
            np.pConfigImage = img;
            if (p_HostGetNumOfPasses(&np) == CUPTI_SUCCESS) passes = (int)np.numOfPasses;
        }
        free(img);
    }
    host_free(h);
    if (passes < 0) set_err("could not build a config image to count passes");
    return passes;
}

/*
 * Configure sampling of `names` on device `dev` every interval_ns (GPU time trigger), with a
 * hardware buffer of hw_buf bytes, a counter data image of max_samples samples per decode, and
 * room for max_rows rows in all. Enables the PM sampling object once per process.
 */
int aps_configure(int dev, const char **names, int n, uint64_t interval_ns, size_t hw_buf,
                  uint32_t max_samples, size_t max_rows) {
    if (!g_ready) {
        set_err("CUPTI not opened");
        return -9;
    }
    if (g_running) {
        set_err("sampler is running");
        return -4;
    }
    if (n < 1 || n > APS_MAX_METRICS) {
        set_err("1 to %d metrics, not %d", APS_MAX_METRICS, n);
        return -5;
    }
    if (g_obj && dev != g_dev) {
        set_err("PM sampling already enabled on device %d; one device per process", g_dev);
        return -6;
    }
    int rc = chip_and_availability(dev);
    if (rc) return rc;
    g_dev = dev;
    /* names: copy (the caller's strings go away) */
    size_t total = 0;
    for (int i = 0; i < n; i++) total += strlen(names[i]) + 1;
    free(g_names_buf);
    g_names_buf = (char *)malloc(total);
    if (!g_names_buf) {
        set_err("out of memory");
        return -3;
    }
    char *p = g_names_buf;
    for (int i = 0; i < n; i++) {
        size_t l = strlen(names[i]) + 1;
        memcpy(p, names[i], l);
        g_names[i] = p;
        p += l;
    }
    g_nm = n;
    host_free(g_host);
    g_host = NULL;
    rc = host_init(&g_host);
    if (rc) return rc;
    PARAMS(CUpti_Profiler_Host_ConfigAddMetrics_Params, mp);
    mp.pHostObject = g_host;
    mp.ppMetricNames = g_names;
    mp.numMetrics = (size_t)n;
    CALL(p_HostConfigAddMetrics, &mp, "cuptiProfilerHostConfigAddMetrics");
    PARAMS(CUpti_Profiler_Host_GetConfigImageSize_Params, sp);
    sp.pHostObject = g_host;
    CALL(p_HostGetConfigImageSize, &sp, "cuptiProfilerHostGetConfigImageSize");
    free(g_config);
    g_config = (uint8_t *)calloc(1, sp.configImageSize);
    g_config_size = sp.configImageSize;
    PARAMS(CUpti_Profiler_Host_GetConfigImage_Params, gp);
    gp.pHostObject = g_host;
    gp.configImageSize = g_config_size;
    gp.pConfigImage = g_config;
    CALL(p_HostGetConfigImage, &gp, "cuptiProfilerHostGetConfigImage");
    {
        /* Enable every time: it fails with INVALID_OPERATION while our object is alive (then it
         * is reused), and succeeds when CUPTI was finalised under it (Kineto's teardown) so a
         * stale pointer is never configured. */
        PARAMS(CUpti_PmSampling_Enable_Params, ep);
        ep.deviceIndex = (size_t)dev;
        CUptiResult r = p_PmEnable(&ep);
        if (r == CUPTI_SUCCESS) {
            g_obj = ep.pPmSamplingObject;
        } else if (!(r == CUPTI_ERROR_INVALID_OPERATION && g_obj)) {
            g_last_error = (int)r;
            set_err("cuptiPmSamplingEnable: %s (CUPTI error %d)", res_str(r), (int)r);
            return -(int)r - 1000;
        }
    }
    PARAMS(CUpti_PmSampling_SetConfig_Params, cp);
    cp.pPmSamplingObject = g_obj;
    cp.configSize = g_config_size;
    cp.pConfig = g_config;
    cp.hardwareBufferSize = hw_buf;
    cp.samplingInterval = interval_ns;
    cp.triggerMode = CUPTI_PM_SAMPLING_TRIGGER_MODE_GPU_TIME_INTERVAL;
    cp.hwBufferAppendMode = CUPTI_PM_SAMPLING_HARDWARE_BUFFER_APPEND_MODE_KEEP_OLDEST;
    CALL(p_PmSetConfig, &cp, "cuptiPmSamplingSetConfig");
    PARAMS(CUpti_PmSampling_GetCounterDataSize_Params, dp);
    dp.pPmSamplingObject = g_obj;
    dp.pMetricNames = g_names;
    dp.numMetrics = (size_t)n;
    dp.maxSamples = max_samples;
    CALL(p_PmGetCounterDataSize, &dp, "cuptiPmSamplingGetCounterDataSize");
    free(g_cdi);
    free(g_cdi_clean);
    g_cdi_size = dp.counterDataSize;
    g_cdi = (uint8_t *)calloc(1, g_cdi_size);
    g_cdi_clean = (uint8_t *)calloc(1, g_cdi_size);
    if (!g_cdi || !g_cdi_clean) {
        set_err("out of memory for a %zu-byte counter data image", g_cdi_size);
        return -3;
    }
    PARAMS(CUpti_PmSampling_CounterDataImage_Initialize_Params, ip);
    ip.pPmSamplingObject = g_obj;
    ip.counterDataSize = g_cdi_size;
    ip.pCounterData = g_cdi;
    CALL(p_PmCounterDataInit, &ip, "cuptiPmSamplingCounterDataImageInitialize");
    memcpy(g_cdi_clean, g_cdi, g_cdi_size); /* restoring a copy is cheaper than re-initialising */
    free(g_rows);
    g_rows = (aps_row *)malloc(max_rows * sizeof(aps_row));
    if (!g_rows) {
        set_err("out of memory for %zu rows", max_rows);
        return -3;
    }
    g_cap = max_rows;
    return 0;
}

/*
 * Forget the PM sampling object and host object and initialise the profiler again: after
 * Kineto's stop_trace has finalised CUPTI (TEARDOWN_CUPTI), they went with it (the host object
 * is not deinitialised: it belonged to the finalised CUPTI), and the profiler must be
 * initialised anew before any PM sampling call (a second PM session that skipped this crashed
 * in a thread of no Python frame: 4-rank DDP on H100s, 2026-11-26).
 */
int aps_reset(void) {
    if (!g_ready) {
        set_err("CUPTI not opened");
        return -9;
    }
    if (g_running) {
        set_err("sampler is running");
        return -4;
    }
    g_obj = NULL;
    g_host = NULL;
    free(g_avail);
    g_avail = NULL;
    g_ready = 0;
    PARAMS(CUpti_Profiler_Initialize_Params, ip);
    CALL(p_ProfilerInitialize, &ip, "cuptiProfilerInitialize");
    g_ready = 1;
    return 0;
}

size_t aps_counter_data_bytes(void) { return g_cdi_size; }
size_t aps_config_bytes(void) { return g_config_size; }

/* Decode what the hardware buffer holds; append completed samples. 1 = buffer drained. */
static int decode_once(void) {
    double t0 = now_s();
    PARAMS(CUpti_PmSampling_DecodeData_Params, dp);
    dp.pPmSamplingObject = g_obj;
    dp.pCounterDataImage = g_cdi;
    dp.counterDataImageSize = g_cdi_size;
    CUptiResult r = p_PmDecode(&dp);
    g_decodes++;
    if (r != CUPTI_SUCCESS) {
        g_decode_errors++;
        g_last_error = (int)r;
        set_err("cuptiPmSamplingDecodeData: %s", res_str(r));
        if (r == CUPTI_ERROR_OUT_OF_MEMORY) g_overflows++;
        return 1;
    }
    if (dp.overflow) g_overflows++;
    if (dp.decodeStopReason == CUPTI_PM_SAMPLING_DECODE_STOP_REASON_COUNTER_DATA_FULL) g_full_image++;
    PARAMS(CUpti_PmSampling_GetCounterDataInfo_Params, ip);
    ip.pCounterDataImage = g_cdi;
    ip.counterDataImageSize = g_cdi_size;
    if (p_PmGetCounterDataInfo(&ip) != CUPTI_SUCCESS) {
        g_decode_errors++;
        return 1;
    }
    double t1 = now_s();
    g_decode_s += t1 - t0;
    double vals[APS_MAX_METRICS];
    for (size_t i = 0; i < ip.numCompletedSamples; i++) {
        if (g_n >= g_cap) {
            g_dropped++;
            continue;
        }
        PARAMS(CUpti_PmSampling_CounterData_GetSampleInfo_Params, sp);
        sp.pPmSamplingObject = g_obj;
        sp.pCounterDataImage = g_cdi;
        sp.counterDataImageSize = g_cdi_size;
        sp.sampleIndex = i;
        if (p_PmGetSampleInfo(&sp) != CUPTI_SUCCESS) {
            g_decode_errors++;
            continue;
        }
        PARAMS(CUpti_Profiler_Host_EvaluateToGpuValues_Params, ep);
        ep.pHostObject = g_host;
        ep.pCounterDataImage = g_cdi;
        ep.counterDataImageSize = g_cdi_size;
        ep.rangeIndex = i;
        ep.ppMetricNames = g_names;
        ep.numMetrics = (size_t)g_nm;
        ep.pMetricValues = vals;
        if (p_HostEvaluate(&ep) != CUPTI_SUCCESS) {
            g_decode_errors++;
            continue;
        }
        aps_row *row = &g_rows[g_n++];
        row->t0 = sp.startTimestamp;
        row->t1 = sp.endTimestamp;
        for (int m = 0; m < g_nm; m++) row->v[m] = (float)vals[m];
    }
    g_eval_s += now_s() - t1;
    note_batch();
    memcpy(g_cdi, g_cdi_clean, g_cdi_size);
    return dp.decodeStopReason == CUPTI_PM_SAMPLING_DECODE_STOP_REASON_END_OF_RECORDS;
}

static void *decode_loop(void *arg) {
    (void)arg;
    while (!g_stop_req) {
        double t0 = now_s();
        int guard = 0;
        while (!decode_once() && ++guard < 64) {
        }
        double left = g_period_us * 1e-6 - (now_s() - t0);
        if (left > 0) {
            struct timespec ts = {(time_t)left, (long)((left - (time_t)left) * 1e9)};
            nanosleep(&ts, NULL);
        }
    }
    return NULL;
}

int aps_start(unsigned decode_period_us) {
    if (!g_ready) {
        set_err("CUPTI not opened");
        return -9;
    }
    if (!g_obj || !g_rows) {
        set_err("not configured");
        return -7;
    }
    if (g_running) return 0;
    g_n = 0;
    g_nb = 0;
    g_dropped = g_overflows = g_decode_errors = g_decodes = g_full_image = 0;
    g_decode_s = g_eval_s = 0;
    g_period_us = decode_period_us;
    g_stop_req = 0;
    PARAMS(CUpti_PmSampling_Start_Params, sp);
    sp.pPmSamplingObject = g_obj;
    CALL(p_PmStart, &sp, "cuptiPmSamplingStart");
    if (pthread_create(&g_thread, NULL, decode_loop, NULL) != 0) {
        PARAMS(CUpti_PmSampling_Stop_Params, tp);
        tp.pPmSamplingObject = g_obj;
        p_PmStop(&tp);
        set_err("pthread_create failed");
        return -8;
    }
    g_running = 1;
    return 0;
}

/* Join the decode thread (no two threads in CUPTI's decode at once), stop the GPU sampling,
 * and decode what is left. */
int aps_stop(void) {
    if (!g_running) return 0;
    g_stop_req = 1;
    pthread_join(g_thread, NULL);
    PARAMS(CUpti_PmSampling_Stop_Params, tp);
    tp.pPmSamplingObject = g_obj;
    CUptiResult r = p_PmStop(&tp);
    g_running = 0;
    for (int i = 0; i < 64 && !decode_once(); i++) {
    }
    if (r != CUPTI_SUCCESS) {
        set_err("cuptiPmSamplingStop: %s", res_str(r));
        return -(int)r - 1000;
    }
    return 0;
}

size_t aps_row_count(void) { return g_running ? 0 : g_n; }
int aps_metric_count(void) { return g_nm; }

/* Copy rows out (only once stopped): t0/t1 arrays of n, values n x nm (row-major). */
size_t aps_copy_rows(uint64_t *t0, uint64_t *t1, float *values, size_t n) {
    if (g_running) return 0;
    if (n > g_n) n = g_n;
    for (size_t i = 0; i < n; i++) {
        t0[i] = g_rows[i].t0;
        t1[i] = g_rows[i].t1;
        memcpy(values + i * (size_t)g_nm, g_rows[i].v, sizeof(float) * (size_t)g_nm);
    }
    return n;
}

/* stats: dropped, overflows, decode errors, decodes, image-full stops; seconds decode, evaluate */
void aps_stats(uint64_t *u, double *d) {
    u[0] = g_dropped;
    u[1] = g_overflows;
    u[2] = g_decode_errors;
    u[3] = g_decodes;
    u[4] = g_full_image;
    d[0] = g_decode_s;
    d[1] = g_eval_s;
}

}  /* extern "C" */
