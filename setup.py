"""Build of kimi_experts._C: the C module (csrc/), the CPU backend (csrc/cpu/) and,
when a CUDA toolkit is found, the CUDA kernels (kernels/*.cu) linked into the same
extension with the static CUDA runtime.

CUDA or CPU-only is decided here, once, and printed:
  KIMI_EXPERTS_CUDA=0   CPU-only, whatever is installed.
  KIMI_EXPERTS_CUDA=1   CUDA required: fail if no usable nvcc is found.
  unset (or "auto")     CUDA when nvcc (CUDA_HOME/bin, CUDA_PATH/bin, PATH, then
                        /usr/local/cuda/bin) is >= 12.0 and its toolkit has
                        cuda_runtime_api.h and libcudart_static.a; otherwise CPU-only.
The .cu files compile in parallel (KIMI_EXPERTS_JOBS, default: all cores) while the C
files compile; their objects live in build/kernels-<config>/ and are reused while newer
than their sources and the kernels/ headers.
OpenMP is used for the CPU backend when the compiler accepts -fopenmp
(KIMI_EXPERTS_OPENMP=0 turns it off).
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a"]
NVCC_FLAGS = ARCH_FLAGS + [
    "-O3",
    "-std=c++17",
    "-Xcompiler",
    "-fPIC",
    "--expt-relaxed-constexpr",
]
# For A/B timing only (benchmarks/compare_builds.py --pads): this many never-run instructions ahead
# of the experts kernel's epilogue and producer code, which moves it against the MMA loops' code;
# where it lands moves some launches by up to 3.6 % (NOTES, session 58). 0: none (every other build).
try:
    PLACEMENT_PAD = int(os.environ.get("KIMI_EXPERTS_PLACEMENT_PAD", "0") or "0")
except ValueError:
    PLACEMENT_PAD = -1
if PLACEMENT_PAD < 0:
    sys.exit("KIMI_EXPERTS_PLACEMENT_PAD must be a count of instructions (0 or more)")
if PLACEMENT_PAD:
    NVCC_FLAGS.append(f"-DKX_PLACEMENT_PAD={PLACEMENT_PAD}")
MIN_CUDA = (12, 0)  # sm_90a needs CUDA 12.0


def log(message):
    print(f"kimi_experts build: {message}", flush=True)


def rel(path):
    return os.path.relpath(path, ROOT)


# ---- the CUDA decision ------------------------------------------------------------


def _nvcc_candidates():
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            yield os.path.join(home, "bin", "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        yield on_path
    yield "/usr/local/cuda/bin/nvcc"


def _toolkit_root(nvcc):
    """The toolkit nvcc belongs to (nvcc may be a wrapper script elsewhere)."""
    real = os.path.realpath(nvcc)
    guess = os.path.dirname(os.path.dirname(real))
    if os.path.exists(os.path.join(guess, "include", "cuda_runtime_api.h")):
        return guess
    # Ask nvcc itself: its dry run prints the directory it runs from.
    try:
        out = subprocess.run(
            [nvcc, "-dryrun", "--version"], capture_output=True, text=True, timeout=60
        )
        match = re.search(r"^#\$ _HERE_=(.*)$", out.stdout + out.stderr, re.M)
        if match:
            return os.path.dirname(match.group(1).strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _nvcc_version(nvcc):
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", out.stdout)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _cudart_static_dir(root):
    for sub in ("lib64", os.path.join("targets", "x86_64-linux", "lib"),
                os.path.join("targets", "sbsa-linux", "lib"), "lib"):
        if os.path.exists(os.path.join(root, sub, "libcudart_static.a")):
            return os.path.join(root, sub)
    return None


def find_cuda():
    """(toolkit dict or None, one line saying what was chosen and why)."""
    wanted = os.environ.get("KIMI_EXPERTS_CUDA", "auto").strip().lower()
    if wanted in ("0", "off", "no", "false"):
        return None, "KIMI_EXPERTS_CUDA=0"
    problems = []
    for nvcc in _nvcc_candidates():
        if not os.path.isfile(nvcc) or not os.access(nvcc, os.X_OK):
            continue
        version = _nvcc_version(nvcc)
        root = _toolkit_root(nvcc)
        libdir = _cudart_static_dir(root) if root else None
        if version is None:
            problems.append(f"{nvcc}: could not read its version")
        elif version < MIN_CUDA:
            problems.append(f"{nvcc}: CUDA {version[0]}.{version[1]} is older than 12.0 (sm_90a)")
        elif root is None or not os.path.exists(
            os.path.join(root, "include", "cuda_runtime_api.h")
        ):
            problems.append(f"{nvcc}: no include/cuda_runtime_api.h beside it")
        elif libdir is None:
            problems.append(f"{nvcc}: no libcudart_static.a in its toolkit {root}")
        else:
            return {"nvcc": nvcc, "root": root, "libdir": libdir, "version": version}, ""
    reason = "; ".join(problems) if problems else "no nvcc found (CUDA_HOME, CUDA_PATH, PATH)"
    if wanted in ("1", "on", "yes", "true"):
        sys.exit(f"kimi_experts build: KIMI_EXPERTS_CUDA=1 but {reason}")
    return None, reason


# ---- the build ----------------------------------------------------------------------


def _jobs():
    try:
        return max(1, int(os.environ.get("KIMI_EXPERTS_JOBS", "0")) or os.cpu_count() or 1)
    except ValueError:
        return os.cpu_count() or 1


def _newer(target, sources):
    if not os.path.exists(target):
        return True
    mtime = os.path.getmtime(target)
    return any(os.path.getmtime(src) > mtime for src in sources)


def _kernel_object_dir(cuda, build_temp):
    """Where nvcc's objects go: build/kernels-<config>/ in the checkout, which outlives
    pip's temporary build folders (pip install -e . builds in a new one each time), so
    only changed .cu files recompile. One folder per toolkit and flag set."""
    key = hashlib.sha1(repr((cuda["nvcc"], cuda["version"], NVCC_FLAGS)).encode()).hexdigest()
    for base in (os.path.join(ROOT, "build"), os.path.abspath(build_temp)):
        path = os.path.join(base, f"kernels-{key[:10]}")
        try:
            os.makedirs(path, exist_ok=True)
            return path
        except OSError:
            continue
    raise RuntimeError("no writable folder for the CUDA objects")


class BuildExt(build_ext):
    """build_ext that compiles C sources in parallel and links nvcc objects in."""

    def build_extensions(self):
        self._parallel_c_compile()
        for ext in self.extensions:
            self._add_openmp(ext)
        super().build_extensions()

    def build_extension(self, ext):
        # A change of configuration (CUDA on/off, toolkit) must rebuild everything,
        # also when no source changed: compare with what the last build recorded.
        stamp = os.path.join(self.build_temp, "kimi_experts_config.txt")
        old = open(stamp).read() if os.path.exists(stamp) else None
        self._forced_by_user = self.force
        if old != ext.kx_config:
            self.force = True  # the C objects; the CUDA objects' folder is per config
        self._build_extension(ext)
        os.makedirs(self.build_temp, exist_ok=True)
        with open(stamp, "w") as f:
            f.write(ext.kx_config)

    def _build_extension(self, ext):
        cuda = ext.kx_cuda
        if not cuda:
            return super().build_extension(ext)
        headers = glob(os.path.join(ROOT, "kernels", "*.h")) + glob(
            os.path.join(ROOT, "kernels", "*.cuh")
        )
        objdir = _kernel_object_dir(cuda, self.build_temp)
        jobs = []
        for src in sorted(glob(os.path.join(ROOT, "kernels", "*.cu"))):
            obj = os.path.join(objdir, os.path.basename(src)[:-3] + ".o")
            jobs.append((src, obj, _newer(obj, [src] + headers) or self._forced_by_user))
        ext.extra_objects = [obj for _, obj, _ in jobs] + list(ext.extra_objects or [])

        def nvcc(src, obj):
            cmd = [cuda["nvcc"], *NVCC_FLAGS, "-I", os.path.join(ROOT, "kernels"),
                   "-c", src, "-o", obj]
            log("nvcc " + rel(src))
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(
                    f"nvcc failed on {rel(src)} (exit {done.returncode}):\n"
                    f"{' '.join(cmd)}\n{done.stdout}{done.stderr}\n"
                    "(set KIMI_EXPERTS_CUDA=0 to build the CPU backend only)"
                )
            if done.stderr.strip():
                sys.stderr.write(done.stderr)

        stale = [(src, obj) for src, obj, is_stale in jobs if is_stale]
        log(f"{len(stale)} of {len(jobs)} CUDA files to compile, {_jobs()} at a time")
        pool = ThreadPoolExecutor(max_workers=_jobs())
        futures = [pool.submit(nvcc, src, obj) for src, obj in stale]
        link = self.compiler.link

        def link_after_nvcc(*args, **kwargs):
            for future in futures:
                future.result()  # re-raises nvcc's failure
            return link(*args, **kwargs)

        self.compiler.link = link_after_nvcc  # the C files compile while nvcc runs
        try:
            super().build_extension(ext)
        finally:
            self.compiler.link = link
            pool.shutdown(wait=True, cancel_futures=True)

    def _parallel_c_compile(self):
        """Compile one extension's C sources concurrently (distutils does one at a time)."""
        compiler = self.compiler
        jobs = _jobs()

        def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                    extra_preargs=None, extra_postargs=None, depends=None):
            macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
                output_dir, macros, include_dirs, sources, depends, extra_postargs
            )
            cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

            def one(obj):
                src, ext = build[obj]
                compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

            with ThreadPoolExecutor(max_workers=jobs) as pool:
                list(pool.map(one, [obj for obj in objects if obj in build]))
            return objects

        if all(hasattr(compiler, name) for name in ("_setup_compile", "_get_cc_args", "_compile")):
            compiler.compile = compile

    def _add_openmp(self, ext):
        if os.environ.get("KIMI_EXPERTS_OPENMP", "1") == "0":
            log("OpenMP: off (KIMI_EXPERTS_OPENMP=0)")
            return
        flag = "-fopenmp"
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "omp.c")
            with open(src, "w") as f:
                f.write("#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n")
            try:
                objs = self.compiler.compile([src], output_dir=tmp, extra_postargs=[flag])
                self.compiler.link_executable(objs, "omp", output_dir=tmp, extra_postargs=[flag])
            except Exception:  # noqa: BLE001 - any failure means: no OpenMP here
                log("OpenMP: not supported by the C compiler; the CPU backend runs serially")
                return
        ext.extra_compile_args.append(flag)
        ext.extra_link_args.append(flag)
        log("OpenMP: on")


def make_extension():
    cuda, why = find_cuda()
    sources = sorted(glob(os.path.join("csrc", "*.c"))) + sorted(
        glob(os.path.join("csrc", "cpu", "*.c"))
    )
    import numpy  # a build requirement (pyproject.toml)

    include_dirs = ["csrc", os.path.join("csrc", "cpu"), numpy.get_include()]
    macros = []
    libraries = ["m"]
    library_dirs = []
    link_args = []
    if cuda:
        version = "%d.%d" % cuda["version"]
        desc = f"CUDA kernels for sm_90a (nvcc {version}) + CPU backend"
        if PLACEMENT_PAD:
            desc += f", placement pad {PLACEMENT_PAD} (a timing build)"
        log(f"CUDA: yes, kernels for sm_90a with {cuda['nvcc']} (CUDA {version}, "
            f"toolkit {cuda['root']})")
        include_dirs += ["kernels", os.path.join(cuda["root"], "include")]
        macros += [("KX_WITH_CUDA", "1")]
        libraries += ["cudart_static", "dl", "rt", "pthread", "stdc++"]
        library_dirs.append(cuda["libdir"])
        # Keep the static CUDA runtime's symbols private to this extension.
        link_args.append("-Wl,--exclude-libs,ALL")
    else:
        note = ("built without CUDA kernels (no nvcc at build time)"
                if why.startswith("no nvcc") else f"built without CUDA kernels ({why})")
        desc = "CPU backend only: " + note
        macros.append(("KX_BUILD_NOTE", f'"{note}"'))
        log(f"CUDA: no ({why}); building the CPU backend only")
    macros.append(("KX_BUILD_DESC", f'"{desc}"'))
    ext = Extension(
        "kimi_experts._C",
        sources=sources,
        include_dirs=include_dirs,
        define_macros=macros,
        libraries=libraries,
        library_dirs=library_dirs,
        extra_compile_args=["-std=c11", "-O3", "-Wall", "-Wno-unused-parameter"],
        extra_link_args=link_args,
        depends=glob(os.path.join("csrc", "*.h")) + glob(os.path.join("csrc", "cpu", "*.h"))
        + glob(os.path.join("kernels", "*.h"))
        + (glob(os.path.join("kernels", "*.cu*")) if cuda else []),
    )
    ext.kx_cuda = cuda
    ext.kx_config = repr((desc, macros, libraries, library_dirs, NVCC_FLAGS if cuda else None))
    return ext


setup(ext_modules=[make_extension()], cmdclass={"build_ext": BuildExt})
