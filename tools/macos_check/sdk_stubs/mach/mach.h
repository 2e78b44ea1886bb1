// Test-only stand-in (see ../README.md): the Mach types metal-cpp names
// (arm64: kern_return_t is int, task_id_token_t a mach_port_t).
#pragma once
typedef int kern_return_t;
typedef unsigned int mach_port_t;
typedef mach_port_t task_id_token_t;
