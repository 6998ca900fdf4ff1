#!/usr/bin/env bash
# Fills .whl/ with every wheel the server needs on a GPU machine that has no network (Python 3.12, x86_64,
# manylinux, glibc >= 2.31), plus question.wav and thanks.wav (speech for the device scripts) and INSTALL.txt.
# That machine already has torch, torchaudio, numpy, aiohttp, onnxruntime, tokenizers, safetensors, prometheus-client,
# attrs, httpx, click and the like (DEVICE_HAS below); what is carried is pinned here, one version of each package,
# the versions that .venv (scripts/setup.sh) tests with. The project itself is not carried: the device runs it from
# the repo root (python3 -m rtc_agent.cli).
# Everything that crosses to the device, repo included, must fit in 64 MiB, so .whl/ must stay under 58 MiB. Four
# wheels are repacked smaller (same file names, RECORD rewritten):
#   av            its Cython modules lose their debug info (strip --strip-debug); av.libs/ (FFmpeg) is untouched
#   silero-vad    drops the three model variants that no code in the package loads (half precision, op18 "ifless",
#                 OpenVINO); load_silero_vad's files (silero_vad.jit, the server's, and the .onnx ones) stay
#   transformers  keeps transformers/models/ only for the model folders the server's path imports (KEEP_MODELS, and
#                 what they import in turn)
#   pipecat-ai    keeps only the Smart Turn model file and the __init__.py files on its way (the server finds the file
#                 with importlib.util.find_spec("pipecat") and never imports pipecat), so it is installed without its
#                 dependencies (--no-deps, as INSTALL.txt says for every wheel)
# The wheels as published are kept in .cache/device_wheels/, so running it again downloads nothing.
# Needs: network, pip, strip (binutils), espeak-ng and sox (scripts/setup.sh installs them).
# Usage (repo root): bash scripts/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
out=.whl
cache=.cache/device_wheels
limit_mib=58

pins=(
    transformers==5.23.0 huggingface-hub==1.33.0  # transformers 5.23 needs huggingface-hub >= 1.31; 2.x needs httpx2
    aiortc==1.16.0 aioice==0.13.0 av==18.1.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 google-crc32c==1.9.0
    pyee==13.0.1 pylibsrtp==1.0.0 pyopenssl==26.4.0 dnspython==2.9.2 ifaddr==0.2.0
    silero-vad==6.2.3 pipecat-ai==1.14.0 llguidance==1.9.1 onnx-ir==1.1.0  # onnx-ir: the captions' 8-bit decoder
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1  # device_tools.sh
)
platforms=()  # llguidance needs glibc 2.31; offering higher ones would raise what the device must have
for n in $(seq 31 -1 5); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)

mkdir -p "$out" "$cache"
"$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none "${platforms[@]}" -d "$cache" "${pins[@]}"

# Copy or repack each pinned wheel from the cache into .whl/, then check the set.
"$py" - "$cache" "$out" "$limit_mib" "${pins[@]}" <<'PY'
import base64, hashlib, re, subprocess, sys, tempfile, zipfile
from pathlib import Path
try:
    from packaging import tags
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:
    from pip._vendor.packaging import tags
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

cache, out, limit_mib, pins = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
# transformers/models/ folders on the server's path; the folders they import are added (closure below)
KEEP_MODELS = {"auto", "qwen3_omni_moe", "qwen2", "qwen2_5_omni", "whisper", "qwen2_vl", "qwen2_5_vl", "qwen3",
               "qwen3_moe", "llama"}
SILERO_UNUSED = {f"silero_vad/data/silero_vad_{v}.onnx" for v in ("half", "op18_ifless", "openvino_16k")}
SMART_TURN = "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
# already on the device, or not needed there: typer is the transformers CLI's, hf-xet the Hub's downloads (no network);
# ml-dtypes comes with onnx, sympy and mpmath with torch
DEVICE_HAS = set(map(canonicalize_name, """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal anyio attrs
    certifi charset-normalizer click cloudpickle filelock frozenlist fsspec h11 httpcore httpx huggingface-hub idna
    jinja2 markupsafe msgpack multidict numpy onnx onnxruntime packaging pillow prometheus-client propcache protobuf
    psutil pyyaml regex requests rich safetensors scipy sentencepiece six tokenizers torch torchaudio tqdm triton
    typing-extensions urllib3 uvloop yarl zipp typer hf-xet ml-dtypes sympy mpmath""".split()))
NO_DEPS = {"pipecat-ai"}  # its dependencies are not carried (it is only a data file here)
# the tags pip on the device accepts, best first (glibc up to 2.31, as downloaded)
platforms = [f"manylinux_2_{n}_x86_64" for n in range(31, 4, -1)] + \
            ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
accepted = list(tags.cpython_tags((3, 12), ["cp312"], platforms)) + \
           list(tags.compatible_tags((3, 12), "cp312", platforms))
rank = {tag: i for i, tag in reversed(list(enumerate(accepted)))}


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def repack(src, dst, keep, transform=lambda name, data: data):
    """Writes `src` to `dst` with only the members `keep(name)` accepts, each passed through `transform`, a fresh
    RECORD, dist-info last, deflate level 9 and the original timestamps (the same input gives the same bytes)."""
    with zipfile.ZipFile(src) as zin:
        infos = [i for i in zin.infolist() if not i.is_dir()]
        record = next(i.filename for i in infos if re.fullmatch(r"[^/]+\.dist-info/RECORD", i.filename))
        infos = [i for i in infos if i.filename != record and keep(i.filename)]
        infos.sort(key=lambda i: ".dist-info/" in i.filename)
        lines = []
        with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
            def put(info, data):
                new = zipfile.ZipInfo(info.filename, info.date_time)
                new.external_attr, new.create_system = info.external_attr, info.create_system
                zout.writestr(new, data, zipfile.ZIP_DEFLATED, 9)
            for info in infos:
                data = transform(info.filename, zin.read(info))
                put(info, data)
                lines.append(record_line(info.filename, data))
            put(zin.getinfo(record), "\n".join(lines + [f"{record},,"]) + "\n")


def strip_debug(name, data):
    """av's Cython modules carry their debug info (about 25 MB of the 31 MB unpacked); the code stays as it is."""
    if not (name.startswith("av/") and re.search(r"\.so(\.|$)", name)):
        return data
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(data)
        f.flush()
        subprocess.run(["strip", "--strip-debug", f.name], check=True)
        return Path(f.name).read_bytes()


def transformers_models(src):
    """KEEP_MODELS and every models/ folder their modules import, transitively (modular_*/convert_* files are
    sources for generated code, never imported)."""
    imports = re.compile(r"^\s*(?:from|import)\s+(\S+)", re.M)
    with zipfile.ZipFile(src) as z:
        files = {n: z.read(n).decode("utf-8", "replace") for n in z.namelist()
                 if n.startswith("transformers/models/") and n.endswith(".py")}
    folders = {n.split("/")[2] for n in files if n.count("/") > 2}

    def imported(path):
        for mod in imports.findall(files[path]):
            if mod.startswith("."):
                dots = len(mod) - len(mod.lstrip("."))
                parts = path.split("/")[:-1][:len(path.split("/")) - dots] + mod.lstrip(".").split(".")
            else:
                parts = mod.split(".")
            if parts[:2] == ["transformers", "models"] and len(parts) > 2 and parts[2] in folders:
                yield parts[2]

    keep, todo = set(), set(KEEP_MODELS)
    while todo:
        folder = todo.pop()
        keep.add(folder)
        for path in files:
            if path.startswith(f"transformers/models/{folder}/") and not \
                    path.rsplit("/", 1)[1].startswith(("modular_", "convert_")):
                todo |= set(imported(path)) - keep
    return keep


for old in out.glob("*.whl"):
    old.unlink()
for pin in pins:
    name, version = pin.split("==")
    stem = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"
    # the best match in the cache (an earlier run may have left a wheel for other platforms)
    src = min((p for p in cache.glob("*.whl") if p.name.lower().startswith(stem)),
              key=lambda p: min(rank.get(t, len(rank)) for t in parse_wheel_filename(p.name)[3]))
    dst = out / src.name
    if name == "av":
        repack(src, dst, lambda n: True, strip_debug)
    elif name == "silero-vad":
        repack(src, dst, lambda n: n not in SILERO_UNUSED)
    elif name == "transformers":
        models = transformers_models(src)
        print("transformers: keeping models/", " ".join(sorted(models)))
        repack(src, dst, lambda n: not re.match(r"transformers/models/[^/]+/", n) or n.split("/")[2] in models)
    elif name == "pipecat-ai":
        parts = SMART_TURN.split("/")
        path_inits = {"/".join(parts[:i]) + "/__init__.py" for i in range(1, len(parts))}
        repack(src, dst, lambda n: n == SMART_TURN or n in path_inits or
               (".dist-info/" in n and not n.endswith("/entry_points.txt")))
    else:
        dst.write_bytes(src.read_bytes())

# Checks: tags a cp312 manylinux x86_64 interpreter accepts, one version of each package, dependencies present,
# the Smart Turn model in place, the size.
wheels, problems = {}, []
for w in sorted(out.glob("*.whl")):
    name, version, _, wtags = parse_wheel_filename(w.name)
    if not wtags & rank.keys():
        problems.append(f"{w.name}: not installable on cp312 manylinux x86_64")
    if name in wheels:
        problems.append(f"{name}: two versions ({wheels[name][0]}, {version})")
    wheels[name] = (version, w)
env = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name":
    "cpython", "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
for name, (version, w) in wheels.items():
    if name in NO_DEPS:
        continue
    with zipfile.ZipFile(w) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in re.findall(r"^Requires-Dist: (.+)$", meta, re.M):
        req = Requirement(line)
        if (req.marker is None or req.marker.evaluate(env)) and canonicalize_name(req.name) not in \
                set(wheels) | DEVICE_HAS:
            problems.append(f"{name} needs {req}: neither carried nor on the device")
pipecat = [w for n, (_, w) in wheels.items() if n == "pipecat-ai"]
if not pipecat or SMART_TURN not in zipfile.ZipFile(pipecat[0]).namelist():
    problems.append(f"the pipecat-ai wheel lacks {SMART_TURN}")
for w in sorted(out.glob("*.whl")):
    print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20
print(f"{total:8.2f} MiB  {out}/ so far; limit {limit_mib} MiB")
if total >= limit_mib:
    problems.append(f"{out}/ holds {total:.2f} MiB, over the {limit_mib} MiB limit")
if problems:
    sys.exit("device_wheels: " + "\n device_wheels: ".join(problems))
PY

# Where this Python can run the av wheel (cp311-abi3), check that the stripped modules still load and encode the
# codecs aiortc uses (Opus, VP8).
if "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --target "$tmp" \
        "$out"/av-*.whl
    PYTHONPATH=$tmp "$py" - <<'PY'
import av
opus = av.CodecContext.create("libopus", "w")
opus.sample_rate, opus.format, opus.layout = 48000, "s16", "stereo"
frame = av.AudioFrame(format="s16", layout="stereo", samples=960)
frame.sample_rate = 48000
for plane in frame.planes:
    plane.update(bytes(plane.buffer_size))
vp8 = av.CodecContext.create("libvpx", "w")
vp8.width, vp8.height, vp8.pix_fmt = 64, 64, "yuv420p"
packets = opus.encode(frame) + opus.encode(None) + vp8.encode(av.VideoFrame(64, 64, "yuv420p")) + vp8.encode(None)
assert len(packets) >= 2, packets
print(f"device_wheels: av {av.__version__} (stripped) encodes Opus and VP8")
PY
fi

# Speech at 24 kHz (made once: espeak-ng's output does not change): a question that semantic_vad's Smart Turn
# doubts, and a sentence it ends at an early check (docs/performance.md, "Method")
speech() {
    [ -s "$out/$1" ] && return
    tmpwav=$(mktemp --suffix=.wav)
    espeak-ng -w "$tmpwav" "$2"
    sox "$tmpwav" -r 24000 "$out/$1"
    rm -f "$tmpwav"
}
speech question.wav "What is the weather like in Paris today?"
speech thanks.wav "Thank you very much."
# two turns for a camera call (studies/device_camera.sh): the question, 3 s of silence, the thanks
[ -s "$out/two_turn.wav" ] || sox "$out/question.wav" -p pad 0 3 | sox - "$out/thanks.wav" "$out/two_turn.wav"

cat > "$out/INSTALL.txt" <<'EOF'
Wheels for the GPU machine (Python 3.12, no network), made by scripts/device_wheels.sh. From the repo root:

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site

Then run the server from the repo root: python3 -m rtc_agent.cli ...
--no-deps is needed: pipecat-ai is slimmed to its Smart Turn model file, and everything else it would pull in is
either here or already on the machine. .whl/question.wav, thanks.wav and two_turn.wav are speech (24 kHz) for the device scripts.
EOF

total=$(du -cb "$out"/* | tail -1 | cut -f1)
echo "device_wheels: $out/ holds $(awk "BEGIN {printf \"%.2f\", $total / 1048576}") MiB (limit $limit_mib MiB)"
[ "$total" -lt $((limit_mib * 1048576)) ] || { echo "device_wheels: over the limit" >&2; exit 1; }
