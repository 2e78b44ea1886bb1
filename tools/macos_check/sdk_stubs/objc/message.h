// Test-only stand-in (see ../README.md): the SDK declares the dispatch entry
// points without a prototype (OBJC_OLD_DISPATCH_PROTOTYPES=0); callers cast.
#pragma once
#include <objc/runtime.h>

extern "C" {
void objc_msgSend(void);
}
