#!/usr/bin/env bash
# Rank 0's memory under strangers that never prove the secret: rank 0 of a 2-node selftest
# waits (at the common 1,024 open-file limit) while an attacker on loopback
#   headers: opens 4,000 connections, each sending a 64 KiB-header frame prefix and its bytes;
#   tensors: opens 4,000 connections, each sending a tensor prefix declaring 256 MiB and 1 MiB of it;
#   churn:   connects and closes 10,000 times.
# Prints rank 0's resident memory idle, its peak (VmHWM) after each attack, and whether it still
# serves: a real rank 1 then joins and the selftest must pass.
# Usage: benches/preauth_memory.sh   (BIN=path/to/ringtmp to measure another build)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/ringtmp}
[ -x "$BIN" ] || cargo build --release -p ringtmp-cli --quiet
export RINGTMP_SECRET=preauth-bench-secret-0123456789
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
kib() { awk -v k="$2" '$1==k":" {print $2}' "/proc/$1/status"; }
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
for attack in headers tensors churn; do
  prlimit --nofile=1024:1024 "$BIN" node --rank 0 --world-size 2 --master-addr 127.0.0.1 \
    --master-port "$port" --job selftest --size-mib 1 --rounds 3 --pings 3 \
    --connect-timeout 120 >/tmp/preauth-rank0.log 2>&1 &
  rank0=$!
  sleep 1
  idle=$(kib $rank0 VmRSS)
  python3 - "$port" "$attack" <<'PY'
import resource, socket, struct, sys, time
port, attack = int(sys.argv[1]), sys.argv[2]
resource.setrlimit(resource.RLIMIT_NOFILE, (20000, 20000))
def prefix(kind, header_len, payload_len):
    return b"RTMP" + struct.pack("<HBBIQ", 9, kind, 0, header_len, payload_len)
held = []
if attack == "churn":
    for _ in range(10_000):
        try:
            socket.create_connection(("127.0.0.1", port)).close()
        except OSError:
            pass
else:
    if attack == "headers":
        frame = prefix(1, 64 << 10, 0) + b"\0" * (64 << 10)
    else:
        # A tensor header would follow the prefix; the prefix alone declares the payload.
        frame = prefix(2, 32, 256 << 20) + b"\0" * (1 << 20)
    for _ in range(4_000):
        try:
            s = socket.create_connection(("127.0.0.1", port))
            s.setblocking(False)
            try:
                s.send(frame)
            except OSError:
                pass
            held.append(s)
        except OSError:
            pass
    time.sleep(2)
print(f"  {attack}: {len(held)} connections held open")
PY
  peak=$(kib $rank0 VmHWM)
  RINGTMP_LOG=error "$BIN" node --rank 1 --world-size 2 --master-addr 127.0.0.1 \
    --master-port "$port" --connect-timeout 30 >/tmp/preauth-rank1.log 2>&1 && joined=passed || joined=FAILED
  wait $rank0 && served=passed || served=FAILED
  echo "  $attack: rank 0 idle $((idle / 1024)) MiB, peak $((peak / 1024)) MiB (+$(((peak - idle) / 1024)) MiB); the selftest afterwards: rank 1 $joined, rank 0 $served"
done
