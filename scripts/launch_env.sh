# Sourced (not run) by the local launchers, with ROOT set to the repository root: the
# environment every training launch needs.
# megatron orders its overlapped TP communication on a single CUDA work queue
# (docs/design.md §10.12); harmless on the CPU. A value the user set is kept.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# The repository's .venv when no virtual environment is active (scripts/setup_env.sh makes it).
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f "$ROOT/.venv/bin/activate" ]; then
    # shellcheck disable=SC1091
    . "$ROOT/.venv/bin/activate"
fi
