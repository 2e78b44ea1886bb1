// Test-only stand-in (see ../README.md): the opaque IOSurface reference.
#pragma once
typedef struct __IOSurface* IOSurfaceRef;
