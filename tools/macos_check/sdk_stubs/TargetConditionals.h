// Test-only stand-in (see ../README.md): a macOS target.
#pragma once
#define TARGET_OS_OSX 1
#define TARGET_OS_IPHONE 0
