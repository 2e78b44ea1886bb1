// Test-only stand-in (see ../README.md): the CoreFoundation names metal-cpp
// uses, with the SDK's types on arm64. The SDK's header includes the C
// headers below (metal-cpp relies on INFINITY from it).
#pragma once
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef double CFTimeInterval;
typedef const void* CFTypeRef;
typedef long CFIndex;
