"""Repository rule: locate an MPI installation through its compiler wrapper.

$MPICC (default: mpicc) is asked for include dirs, lib dirs and libs:
Open MPI via --showme:{incdirs,libdirs,libs}; MPICH/Intel MPI via -show.
Exposes @<name>//:mpi (headers + libmpi.so, defines OMPI_SKIP_MPICXX=1).
"""

def _fail(msg):
    fail("\n\033[0;31mmpi_configure:\033[0m %s\n" % msg)

def _run(ctx, args):
    r = ctx.execute(args)
    return r.stdout.strip() if r.return_code == 0 else None

def _mpi_configure_impl(ctx):
    mpicc = ctx.os.environ.get("MPICC", "mpicc")
    mpicc = ctx.path(mpicc) if "/" in mpicc else ctx.which(mpicc)
    if mpicc == None or not mpicc.exists:
        _fail("mpicc not found (apt-get install libopenmpi-dev openmpi-bin, or `make deps`); set MPICC")

    incdirs = _run(ctx, [mpicc, "--showme:incdirs"])
    if incdirs != None:  # Open MPI
        incdirs = incdirs.split(" ")
        libdirs = (_run(ctx, [mpicc, "--showme:libdirs"]) or "").split(" ")
        libs = (_run(ctx, [mpicc, "--showme:libs"]) or "mpi").split(" ")
    else:  # MPICH-style wrappers
        show = _run(ctx, [mpicc, "-show"])
        if show == None:
            _fail("%s understands neither --showme nor -show" % mpicc)
        toks = show.split(" ")
        incdirs = [t[2:] for t in toks if t.startswith("-I")]
        libdirs = [t[2:] for t in toks if t.startswith("-L")]
        libs = [t[2:] for t in toks if t.startswith("-l")]
    libdirs = [d for d in libdirs if d]

    # Headers: mpi.h (and friends) from every include dir.
    hdr_dirs = []
    for i, d in enumerate([d for d in incdirs if d]):
        ctx.symlink(d, "include%d" % i)
        hdr_dirs.append("include%d" % i)

    # Libraries: only the C library (mpi); resolve through the lib dirs.
    srcs = []
    rpaths = []
    for lib in libs:
        if lib != "mpi":
            continue
        for d in libdirs + ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"]:
            p = ctx.path(d + "/lib%s.so" % lib)
            if p.exists:
                ctx.symlink(p, "lib/lib%s.so" % lib)
                srcs.append("lib/lib%s.so" % lib)
                real = p.realpath.dirname
                if not (str(real).startswith("/usr/lib") or str(real).startswith("/lib")):
                    rpaths.append("-Wl,-rpath,%s" % real)
                break
    if not srcs:
        _fail("libmpi.so not found in %s" % libdirs)

    version = _run(ctx, [mpicc, "--showme:version"]) or ""
    ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

# MPI wrapper used: {mpicc}  ({version})
cc_library(
    name = "mpi",
    hdrs = glob([{hdr_globs}]),
    includes = {hdr_dirs},
    srcs = {srcs},
    linkopts = {rpaths},
    # mpi.h would otherwise pull in the (deprecated) C++ bindings, whose
    # symbols live in libmpi_cxx and stay undefined in the op library.
    defines = ["OMPI_SKIP_MPICXX=1", "MPICH_SKIP_MPICXX=1"],
)
""".format(
        mpicc = mpicc,
        version = version,
        hdr_globs = ", ".join(['"%s/**/*.h"' % d for d in hdr_dirs]),
        hdr_dirs = repr(hdr_dirs),
        srcs = repr(srcs),
        rpaths = repr(rpaths),
    ))

mpi_configure = repository_rule(
    implementation = _mpi_configure_impl,
    environ = ["MPICC", "PATH"],
    local = True,
)
