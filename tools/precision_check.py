from megatron_boost.cli.precision_check import main
if __name__ == "__main__":
    raise SystemExit(main())
