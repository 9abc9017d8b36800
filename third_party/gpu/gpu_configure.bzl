"""Repository rule: CUDA runtime + NCCL headers/libraries for host-only code.

Only fetched when //cc:_mpi_ops.so is built with --config=cuda.

MPISTRATEGY_CUDA_LINK (env) selects where things come from:
  "tf" (default)  headers bundled in the TensorFlow wheel (the exact CUDA/NCCL
                  versions TF was built with: include/third_party/gpus/cuda,
                  include/external/cuda_nccl); NO libraries are linked: the
                  cuda*/nccl* symbols resolve against libtensorflow_framework.so.2,
                  which exports lazy-loading stubs (it dlopen()s libnccl.so.2 /
                  libcudart.so.12 via its own RUNPATH into site-packages/nvidia).
  "direct"        headers + libnccl.so.2 / libcudart.so.12 from $NCCL_HOME /
                  $CUDA_HOME, else from the nvidia-{nccl,cuda-runtime,cuda-nvcc,
                  cuda-cccl}-cu12 wheels importable by $PYTHON_BIN_PATH; linked
                  with DT_NEEDED + absolute RUNPATH.
"""

load("//third_party/tf:tf_configure.bzl", "find_python")

_PY = """
import importlib, os
print("@@GPU@@")
import tensorflow as tf
print(tf.sysconfig.get_include())
for m in ("nccl", "cuda_runtime", "cuda_nvcc", "cuda_cccl"):
    try:
        print(list(importlib.import_module("nvidia." + m).__path__)[0])
    except Exception:
        print("")
"""

def _fail(msg):
    fail("\n\033[0;31mgpu_configure:\033[0m %s\n" % msg)

def _first_existing(ctx, candidates):
    for c in candidates:
        if c and ctx.path(c).exists:
            return c
    return None

def _gpu_configure_impl(ctx):
    mode = ctx.os.environ.get("MPISTRATEGY_CUDA_LINK", "tf") or "tf"
    python = find_python(ctx)
    r = ctx.execute([python, "-c", _PY],
                    environment = {"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""},
                    timeout = 300)
    if r.return_code != 0 or "@@GPU@@" not in r.stdout:
        _fail("python probe failed:\n" + r.stderr)
    tf_inc, w_nccl, w_cudart, w_nvcc, w_cccl = (
        r.stdout.split("@@GPU@@\n")[1].split("\n")[:5])

    inc_dirs = []  # (symlink name, target)
    libs = []      # (symlink name, target)
    if mode == "tf":
        inc_dirs = [
            ("cuda_include", tf_inc + "/third_party/gpus/cuda/include"),
            ("cccl_include", tf_inc + "/third_party/gpus/cuda/libcudacxx/include"),
            ("nccl_include", tf_inc + "/external/cuda_nccl/include"),
        ]
    elif mode == "direct":
        nccl_home = ctx.os.environ.get("NCCL_HOME", "") or w_nccl
        cuda_home = ctx.os.environ.get("CUDA_HOME", "")
        if cuda_home:
            inc_dirs.append(("cuda_include", cuda_home + "/include"))
            cudart = _first_existing(ctx, [cuda_home + "/lib64/libcudart.so",
                                           cuda_home + "/lib/libcudart.so"])
        else:
            # wheel: runtime headers lack crt/ (in cuda_nvcc) and <nv/target>
            # (in cuda_cccl, which tensorflow[and-cuda] does not pull in:
            # fall back to the copy bundled in the TF wheel).
            if not w_cudart or not w_nvcc:
                _fail("need nvidia-cuda-runtime-cu12 and nvidia-cuda-nvcc-cu12 " +
                      "importable by %s (or set CUDA_HOME)" % python)
            inc_dirs += [("cuda_include", w_cudart + "/include"),
                         ("crt_include", w_nvcc + "/include"),
                         ("cccl_include", (w_cccl + "/include") if w_cccl else
                          (tf_inc + "/third_party/gpus/cuda/libcudacxx/include"))]
            cudart = _first_existing(ctx, [w_cudart + "/lib/libcudart.so.12"])
        if not nccl_home:
            _fail("NCCL not found: set NCCL_HOME or install nvidia-nccl-cu12")
        inc_dirs.append(("nccl_include", nccl_home + "/include"))
        nccl = _first_existing(ctx, [nccl_home + "/lib/libnccl.so.2",
                                     nccl_home + "/lib/libnccl.so",
                                     nccl_home + "/lib64/libnccl.so"])
        if not nccl or not cudart:
            _fail("libnccl (%s) / libcudart (%s) not found" % (nccl, cudart))
        # pip wheels ship only the versioned name; give Bazel a plain .so.
        libs = [("lib/libnccl.so", nccl), ("lib/libcudart.so", cudart)]
    else:
        _fail("MPISTRATEGY_CUDA_LINK must be 'tf' or 'direct', got %r" % mode)

    for name, target in inc_dirs:
        if not ctx.path(target).exists:
            _fail("missing %s (is this a CUDA build of TensorFlow? the " % target +
                  "tensorflow-cpu wheel lacks the CUDA/NCCL headers)")
        ctx.symlink(target, name)
    rpaths = []
    for name, target in libs:
        ctx.symlink(target, name)
        d = str(ctx.path(target).realpath.dirname)
        if ("-Wl,-rpath," + d) not in rpaths:
            rpaths.append("-Wl,-rpath," + d)

    ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

# mode = {mode}
cc_library(
    name = "cuda_nccl",
    hdrs = glob([{globs}]),
    includes = {includes},
    srcs = {srcs},
    linkopts = {rpaths},
)
""".format(
        mode = mode,
        # CCCL: only <nv/target> is needed by cuda_fp16.h (skip cub/thrust).
        globs = ", ".join(['"%s/%s"' % (n, "nv/**" if n == "cccl_include" else "**")
                           for n, _ in inc_dirs]),
        includes = repr([n for n, _ in inc_dirs]),
        srcs = repr([n for n, _ in libs]),
        rpaths = repr(rpaths),
    ))

gpu_configure = repository_rule(
    implementation = _gpu_configure_impl,
    environ = ["MPISTRATEGY_CUDA_LINK", "PYTHON_BIN_PATH", "NCCL_HOME", "CUDA_HOME"],
    local = True,
)
