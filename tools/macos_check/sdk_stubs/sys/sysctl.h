// Test-only stand-in (see ../README.md): the one sysctl call the CPU feature
// detection makes, as the SDK declares it.
#pragma once
#include <stddef.h>

extern "C" int sysctlbyname(const char* name, void* oldp, size_t* oldlenp, void* newp,
                            size_t newlen);
