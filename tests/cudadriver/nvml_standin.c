/* NVML stand-in (libnvidia-ml.so.1) for tests: the few calls gpushare makes
 * (see README.md).  NVML enumerates physical devices and ignores
 * CUDA_VISIBLE_DEVICES; UUIDs match the CUDA stand-in's.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "standin_uuid.h"

#define EXPORT __attribute__((visibility("default")))
#define MAXDEV 16

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};
enum { FABRIC_NOT_SUPPORTED = 0, FABRIC_IN_PROGRESS = 2, FABRIC_COMPLETED = 3 };

struct nvml_device {
    int index;
};
typedef struct nvml_device *nvmlDevice_t;

/* nvmlGpuFabricInfo_v2_t / _v3_t (v3 adds healthSummary at the end). */
typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned char state;
    unsigned int healthMask;
    unsigned char healthSummary;
} nvmlGpuFabricInfoV_t;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_refs;
static int g_count = 2;
static struct nvml_device g_devices[MAXDEV];

static int device_index(nvmlDevice_t d) {
    if (d < g_devices || d >= g_devices + g_count) return -1;
    return (int)(d - g_devices);
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&g_lock);
    if (g_refs++ == 0) {
        const char *n = getenv("GPUSHARE_STANDIN_DEVICES");
        g_count = n && *n ? atoi(n) : 2;
        if (g_count < 0) g_count = 0;
        if (g_count > MAXDEV) g_count = MAXDEV;
        for (int i = 0; i < MAXDEV; i++) g_devices[i].index = i;
    }
    pthread_mutex_unlock(&g_lock);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&g_lock);
    nvmlReturn_t r = g_refs > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (g_refs > 0) g_refs--;
    pthread_mutex_unlock(&g_lock);
    return r;
}

static int inited(void) {
    pthread_mutex_lock(&g_lock);
    int r = g_refs > 0;
    pthread_mutex_unlock(&g_lock);
    return r;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument Version Mismatch";
    default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!inited()) return NVML_ERROR_UNINITIALIZED;
    if (!version) return NVML_ERROR_INVALID_ARGUMENT;
    if (length < 8) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(version, "590.0.0");
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!inited()) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned)g_count;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!inited()) return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= (unsigned)g_count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &g_devices[index];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (!inited()) return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < g_count; i++) {
        char text[48];
        standin_uuid_text(i, text);
        if (strcasecmp(text, uuid) == 0) {
            *device = &g_devices[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    if (!inited()) return NVML_ERROR_UNINITIALIZED;
    int i = device_index(device);
    if (i < 0 || !uuid) return NVML_ERROR_INVALID_ARGUMENT;
    char text[48];
    standin_uuid_text(i, text);
    if (length < strlen(text) + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(uuid, text);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    if (!inited()) return NVML_ERROR_UNINITIALIZED;
    int i = device_index(device);
    if (i < 0 || !index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned)i;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    static const char NAME[] = "gpushare CUDA driver stand-in";
    if (!inited()) return NVML_ERROR_UNINITIALIZED;
    if (device_index(device) < 0 || !name) return NVML_ERROR_INVALID_ARGUMENT;
    if (length < sizeof NAME) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(name, NAME, sizeof NAME);
    return NVML_SUCCESS;
}

/* The clique of physical device i: the i-th entry of GPUSHARE_STANDIN_CLIQUES
   (a comma list of numbers), else 1. */
static unsigned clique_of(int i) {
    const char *list = getenv("GPUSHARE_STANDIN_CLIQUES");
    for (int k = 0; list && *list; k++) {
        char *end;
        unsigned long v = strtoul(list, &end, 10);
        if (end == list) break;
        if (k == i) return (unsigned)v;
        list = *end == ',' ? end + 1 : end;
    }
    return 1;
}

/* GPUSHARE_STANDIN_FABRIC=1: registered with the fabric (COMPLETED, cluster
   UUID and the device's clique); =incomplete: IN_PROGRESS; otherwise
   NOT_SUPPORTED. */
EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfoV_t *info) {
    static const unsigned char CLUSTER[16] = {'g', 's', '-', 's', 't', 'a', 'n', 'd', 'i', 'n', '-', 'i', 'm', 'e', 'x', 1};
    if (!inited()) return NVML_ERROR_UNINITIALIZED;
    if (device_index(device) < 0 || !info) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned v = info->version >> 24;
    if (v != 2 && v != 3) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    const char *f = getenv("GPUSHARE_STANDIN_FABRIC");
    memset(info->clusterUuid, 0, sizeof info->clusterUuid);
    info->status = NVML_SUCCESS;
    info->cliqueId = 0;
    info->healthMask = 0;
    if (f && strcmp(f, "1") == 0) {
        memcpy(info->clusterUuid, CLUSTER, sizeof CLUSTER);
        info->cliqueId = clique_of(device_index(device));
        info->state = FABRIC_COMPLETED;
    } else if (f && strcmp(f, "incomplete") == 0) {
        info->state = FABRIC_IN_PROGRESS;
    } else {
        info->state = FABRIC_NOT_SUPPORTED;
    }
    if (v == 3) info->healthSummary = 0;
    return NVML_SUCCESS;
}
