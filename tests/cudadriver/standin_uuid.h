/* Device UUIDs shared by the CUDA and NVML stand-ins: derived from the
   physical index, the same in every process. */
#ifndef GPUSHARE_STANDIN_UUID_H
#define GPUSHARE_STANDIN_UUID_H

#include <stdio.h>
#include <string.h>

static inline void standin_uuid(int phys, unsigned char out[16]) {
    static const unsigned char tail[12] = {'s', 't', 'a', 'n', 'd', 'i', 'n', '-', 'g', 'p', 'u', 's'};
    out[0] = (unsigned char)(0x10 * ((phys % 15) + 1) + ((phys / 15) & 0xf));
    out[1] = 0x5a;
    out[2] = (unsigned char)phys;
    out[3] = 0x01;
    memcpy(out + 4, tail, 12);
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (41 bytes with the NUL). */
static inline void standin_uuid_text(int phys, char *buf) {
    unsigned char u[16];
    standin_uuid(phys, u);
    sprintf(buf, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2],
            u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

#endif
