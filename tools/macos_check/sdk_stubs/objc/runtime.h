// Test-only stand-in (see ../README.md): the Objective-C runtime names
// metal-cpp uses, as the SDK declares them for C++ (non-ObjC) code.
#pragma once
#include <stdbool.h>

typedef struct objc_class* Class;
struct objc_object {
  Class isa;
};
typedef struct objc_object* id;
typedef struct objc_selector* SEL;
typedef struct objc_object Protocol;

extern "C" {
Class objc_lookUpClass(const char* name);
SEL sel_registerName(const char* str);
Protocol* objc_getProtocol(const char* name);
}
