from megatron_boost.cli.perf_model import main
if __name__ == "__main__":
    raise SystemExit(main())
