"""Pass-through stub of @rules_java for offline Bazel 4 (see ../../repos.bzl)."""

def java_import(**kw):
    native.java_import(**kw)

def java_runtime(**kw):
    native.java_runtime(**kw)

def java_toolchain(**kw):
    native.java_toolchain(**kw)

def java_library(**kw):
    native.java_library(**kw)

def java_binary(**kw):
    native.java_binary(**kw)
