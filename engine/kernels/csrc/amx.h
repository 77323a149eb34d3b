/* AMX tiles: the process's permission to use them and the tile configuration record. Linux hands out AMX tile
 * state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM); where it refuses, or the CPU lacks AMX though
 * the build has it, amx_available() is 0 and callers run their vector paths. The configuration is thread state:
 * a kernel loads its own (amx_config_tiles) before its tile instructions on each thread and releases the tiles after,
 * since other AMX code in the process (oneDNN, through torch) configures its own. */
#ifndef BATCHGEN_AMX_H
#define BATCHGEN_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>

long syscall(long number, ...);   /* glibc's (unistd.h declares it only with _DEFAULT_SOURCE; the build is -std=c11) */

#define BATCHGEN_ARCH_REQ_XCOMP_PERM 0x1023
#define BATCHGEN_XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;

/* Tiles 0 .. n-1 as 16 rows of 64 bytes (palette 1), on the calling thread: every shape our kernels use. Needs the
 * AMX-TILE flags (included only inside the blocks that have them). */
static inline void amx_config_tiles(int n) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < n; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* 1 where this process may run tile instructions (asked once; call it before any parallel region) */
static inline int amx_available(void) {
    static int permitted = -1;
    if (permitted < 0) {
        __builtin_cpu_init();
        permitted = __builtin_cpu_supports("amx-bf16") &&
                    syscall(SYS_arch_prctl, BATCHGEN_ARCH_REQ_XCOMP_PERM, BATCHGEN_XFEATURE_XTILEDATA) == 0;
    }
    return permitted;
}

#endif
