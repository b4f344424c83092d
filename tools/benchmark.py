from megatron_boost.cli.benchmark import main
if __name__ == "__main__":
    raise SystemExit(main())
