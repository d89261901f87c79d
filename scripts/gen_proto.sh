#!/usr/bin/env bash
# Regenerates impala_rep/proto/transport_pb2.py and transport_pb2_grpc.py from
# impala_rep/proto/transport.proto with grpcio-tools. Usage:
#   bash scripts/gen_proto.sh            # writes into the repository (commit the result)
#   bash scripts/gen_proto.sh OUT_DIR    # writes OUT_DIR/impala_rep/proto/*.py (tests compare)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python
OUT="${1:-.}"
mkdir -p "$OUT"
"$PYTHON" -m grpc_tools.protoc -I. --python_out="$OUT" --grpc_python_out="$OUT" \
    impala_rep/proto/transport.proto
