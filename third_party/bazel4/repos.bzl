"""Offline stubs for Debian's bazel-bootstrap 4.2.3 (native.bazel_version is
"" there; `bazel --version` prints "bazel no_version").

Bazel 4's built-in WORKSPACE suffix declares @rules_cc / @rules_java with
maybe(http_archive, ...), i.e. only if the user has not defined them, and would
download them from GitHub.  Defining two tiny pass-through stubs here (before
the suffix) avoids any download.  Likewise @remote_coverage_tools, an implicit
dependency of every test rule (cc_test), normally fetched from
mirror.bazel.build; the stub only makes `bazel coverage` fail.  A released, networked Bazel (any other
version string) is left alone and fetches the genuine rule sets.
"""

def bazel4_offline_repos():
    v = native.bazel_version
    if v == "" or v == "no_version" or v.startswith("4."):
        native.local_repository(name = "rules_cc", path = "third_party/bazel4/rules_cc")
        native.local_repository(name = "rules_java", path = "third_party/bazel4/rules_java")
        native.local_repository(
            name = "remote_coverage_tools",
            path = "third_party/bazel4/remote_coverage_tools",
        )
