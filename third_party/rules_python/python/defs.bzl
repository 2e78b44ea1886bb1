"""Offline shim of rules_python: forwards to Bazel 4's native Python rules."""

def py_binary(**kwargs):
    native.py_binary(**kwargs)

def py_library(**kwargs):
    native.py_library(**kwargs)

def py_runtime(**kwargs):
    native.py_runtime(**kwargs)

def py_test(**kwargs):
    native.py_test(**kwargs)
