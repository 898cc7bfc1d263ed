// FRUGAL_VECTOR_CLONES: a loop written to vectorize gets a second copy built for AVX2 on
// x86-64 with GCC, chosen at load time.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(FRUGAL_NO_CLONES)
#define FRUGAL_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FRUGAL_VECTOR_CLONES
#endif
