// The one C++ runtime entry point GCC 14 and newer emit calls to that the
// libstdc++ of the wheels' manylinux floor lacks (tools/cc_flags.bzl: the
// modern lane's g++-16 links against bookworm's GCC 12 libstdc++).
//
// GCC >= 14 ends an exception escaping a noexcept region (a MUST_NOT_THROW
// landing pad) by calling __cxa_call_terminate, which libstdc++ exports only
// from GCC 14 (CXXABI_1.3.15). Linked against GCC 12's libstdc++ the reference
// would stay undefined and unversioned, and the extension would fail to load
// on a glibc 2.35/2.36 system ("undefined symbol: __cxa_call_terminate").
// This definition is hidden, so the extension binds to it at link time and
// exports nothing (GCC >= 14 declares the function itself, with default
// visibility, so the assembler directive below hides it rather than an
// attribute); it does what libstdc++'s does: mark the exception caught
// (so a terminate handler can inspect it) and terminate. Compilers that do not
// emit the call (the Bazel 4.2 lane's GCC 12) leave it unreferenced and
// --gc-sections drops it.

#include <cxxabi.h>

#include <exception>

extern "C" [[noreturn]] void __cxa_call_terminate(void* exception_header) noexcept {
  if (exception_header != nullptr) {
    __cxxabiv1::__cxa_begin_catch(exception_header);
  }
  std::terminate();
}

__asm__(".hidden __cxa_call_terminate");
