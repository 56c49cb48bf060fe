/* Force-included into llama.cpp's build (README, install): GCC 11-12's _tile_loadconfig declares that it reads 8 of
 * the 64 bytes of an AMX tile configuration, so the optimiser drops ggml's stores to the rest, every tile is left
 * unconfigured and the first AMX multiply faults (SIGILL or SIGSEGV) on any decode of 2 or more positions. GCC 13 fixed the
 * intrinsic; this redefines it to read all 64 bytes. */
#if defined(__AMX_TILE__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#include <immintrin.h>
#undef _tile_loadconfig
#define _tile_loadconfig(config) __asm__ volatile("ldtilecfg\t%X0" ::"m"(*(const char(*)[64])(config)))
#endif
