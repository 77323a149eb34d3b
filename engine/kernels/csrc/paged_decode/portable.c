/* Paged decode attention (driver.h) in its portable loops only: the reference the vector implementations are
 * tested against. */
#include "../dispatch.h"
#include "../kernels.h"

#if PAGED_DECODE_ISA == ISA_PORTABLE
#define FAST_PATH 0
#define PAIRED_PV 0
#define I8_IN_DOT 0
#include "driver.h"
#endif
