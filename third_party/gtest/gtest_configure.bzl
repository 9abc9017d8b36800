"""Repository rule: googletest from the system (Debian's libgtest-dev).

Offline builds cannot download googletest, so the C++ tests use the copy
that `make deps` installs with apt (headers in /usr/include/gtest, static
libraries libgtest.a and libgtest_main.a).  GTEST_PREFIX chooses another
prefix (with include/ and lib/ below it).
Exposes @<name>//:gtest (headers + libgtest.a).
"""

def _fail(msg):
    fail("\n\033[0;31mgtest_configure:\033[0m %s\n" % msg)

def _gtest_configure_impl(ctx):
    prefix = ctx.os.environ.get("GTEST_PREFIX", "/usr")
    include = ctx.path(prefix + "/include/gtest/gtest.h")
    if not include.exists:
        _fail("%s not found: install googletest (apt-get install libgtest-dev, " % include +
              "or `make deps`), or set GTEST_PREFIX")
    library = None
    for d in ["lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu", "lib64", "lib"]:
        p = ctx.path("%s/%s/libgtest.a" % (prefix, d))
        if p.exists:
            library = p
            break
    if library == None:
        _fail("libgtest.a not found under %s/lib*: install libgtest-dev" % prefix)
    ctx.symlink(prefix + "/include/gtest", "include/gtest")
    ctx.symlink(library, "lib/libgtest.a")
    ctx.file("BUILD", """\
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "gtest",
    srcs = ["lib/libgtest.a"],
    hdrs = glob(["include/gtest/**/*.h"]),
    includes = ["include"],
    linkopts = ["-pthread"],
)
""")

gtest_configure = repository_rule(
    implementation = _gtest_configure_impl,
    environ = ["GTEST_PREFIX"],
    local = True,
)
