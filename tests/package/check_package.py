#!/usr/bin/python3
"""The installed package, used the way a new user would: install, build a project outside the tree, run it.

Usage: check_package.py BUILD_DIR SOURCE_DIR PYTHON TORCH_CMAKE_PREFIX

PYTHON is the reference Python with the torch gradsync was built against (its torchrun launches the ranks);
TORCH_CMAKE_PREFIX that libtorch's CMake prefix (a wheel's torch.utils.cmake_prefix_path), given to the consumer.

1. `cmake --install BUILD_DIR --prefix TMP/prefix` (headers, libgradsync.a, the gradsync CLI, gradsyncConfig.cmake,
   gradsync.pc, LICENSE);
2. copies examples/my_trainer/ (its CMakeLists.txt is find_package(gradsync) + target_link_libraries(...
   gradsync::gradsync), nothing else) to TMP/app, configures it with CMAKE_PREFIX_PATH=TMP/prefix;TORCH_CMAKE_PREFIX and builds it;
3. runs it as one process on the global batch, then as 2 ranks under the installed `gradsync launch`, under
   `torchrun --no_python` and under `mpirun -np 2`; every 2-rank result must equal the one-process result
   (tests/reference/compare_states.py, rtol 1e-5) and every saved file must load with
   torch.load(f, weights_only=True);
4. checks that pkg-config finds gradsync.pc, that its flags name the installed library, and that
   `g++ main.cpp $(pkg-config --cflags --libs gradsync)` builds the same program, which then runs.
Exit 0 when everything holds; 1 with the failing step's output otherwise. Every step has a timeout.
"""
import os
import shutil
import subprocess
import sys
import tempfile

PYTHON = "python3"  # set from the command line
STEP_TIMEOUT = 600  # configure + build of one torch TU without a precompiled header takes ~1 min here


def clean_env():
    env = {k: v for k, v in os.environ.items()
           if not (k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                   or k.startswith(("OMPI_", "PMIX_", "GRADSYNC_", "TORCHELASTIC_")))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def run(cmd, what, env=None, cwd=None, timeout=STEP_TIMEOUT):
    print("+", " ".join(cmd), flush=True)
    try:
        r = subprocess.run(cmd, env=env or clean_env(), cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        sys.exit(f"FAIL {what}: timed out after {timeout} s\n{e.stdout or ''}{e.stderr or ''}")
    if r.returncode != 0:
        sys.exit(f"FAIL {what}: exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")
    return r.stdout


def mpirun_args(n):
    args = ["mpirun", "-np", str(n), "--bind-to", "none"]
    if os.geteuid() == 0:
        args.append("--allow-run-as-root")
    if n > (os.cpu_count() or 1):
        args.append("--oversubscribe")
    return args


def main():
    global PYTHON
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    build, source, PYTHON, torch_prefix = (os.path.abspath(p) for p in sys.argv[1:])
    # The torchrun of that torch: the wheel's beside its interpreter, Debian's on the PATH.
    torchrun = os.path.join(os.path.dirname(PYTHON), "torchrun")
    if not os.path.exists(torchrun):
        torchrun = "torchrun"
    tmp = tempfile.mkdtemp(prefix="gradsync-package-")
    try:
        prefix, app = os.path.join(tmp, "prefix"), os.path.join(tmp, "app")
        run(["cmake", "--install", build, "--prefix", prefix], "install")
        for f in ("include/gradsync/gradsync.h", "lib/libgradsync.a", "bin/gradsync",
                  "lib/cmake/gradsync/gradsyncConfig.cmake", "lib/cmake/gradsync/gradsyncConfigVersion.cmake",
                  "lib/pkgconfig/gradsync.pc", "share/doc/gradsync/LICENSE"):
            if not os.path.exists(os.path.join(prefix, f)):
                sys.exit(f"FAIL install: {f} is not installed")
        shutil.copytree(os.path.join(source, "examples", "my_trainer"), app)
        run(["cmake", "-S", app, "-B", os.path.join(app, "build"), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
             f"-DCMAKE_PREFIX_PATH={prefix};{torch_prefix}"], "configure the consumer project")
        run(["cmake", "--build", os.path.join(app, "build")], "build the consumer project")
        exe = os.path.join(app, "build", "my_trainer")
        out = {name: os.path.join(tmp, name + ".pt") for name in ("single", "launch", "torchrun", "mpirun")}
        print(run([exe, out["single"]], "one process"), end="")
        print(run([os.path.join(prefix, "bin", "gradsync"), "launch", "-n", "2", "--", exe, out["launch"]],
                  "gradsync launch -n 2"), end="")
        # --redirects 1 --tee 1: Debian 12's torchrun crashes with Python 3.11 on the default of 0 (to_map).
        print(run([torchrun, "--standalone", "--nproc_per_node", "2", "--redirects", "1", "--tee", "1",
                   "--no_python", exe, out["torchrun"]], "torchrun --no_python"), end="")
        print(run(mpirun_args(2) + [exe, out["mpirun"]], "mpirun -np 2"), end="")
        compare = os.path.join(source, "tests", "reference", "compare_states.py")
        for name in ("launch", "torchrun", "mpirun"):
            print(run([PYTHON, compare, out[name], out["single"], "--rtol", "1e-5", "--atol", "1e-6"],
                      f"{name} equals one process").splitlines()[-1])
        check = "import sys, torch\nfor f in sys.argv[1:]: torch.load(f, weights_only=True)\nprint('weights_only ok')"
        print(run([PYTHON, "-c", check] + list(out.values()), "torch.load(weights_only=True)"), end="")
        env = clean_env()
        env["PKG_CONFIG_PATH"] = os.path.join(prefix, "lib", "pkgconfig")
        flags = run(["pkg-config", "--cflags", "--libs", "gradsync"], "pkg-config", env=env)
        # gradsync.pc is relocatable (${pcfiledir}): its directories must resolve into the prefix it was installed to.
        dirs = {os.path.realpath(f[2:]) for f in flags.split() if f.startswith(("-L", "-I"))}
        wanted = {os.path.realpath(os.path.join(prefix, d)) for d in ("lib", "include")}
        if not wanted <= dirs or "-lgradsync" not in flags.split():
            sys.exit(f"FAIL pkg-config: flags do not name the installed gradsync ({sorted(wanted)}): {flags}")
        # docs/api.md's pkg-config line, as written there: the program builds and runs as one process.
        pc_exe = os.path.join(tmp, "my_trainer_pc")
        run(["g++", "-O2", os.path.join(app, "main.cpp"), "-o", pc_exe] + flags.split(), "build with pkg-config",
            env=env)
        print(run([pc_exe, os.path.join(tmp, "pc.pt")], "the pkg-config build runs"), end="")
        print("package: installed, built outside the tree, 3 launchers equal one process")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
