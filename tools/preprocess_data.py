from megatron_boost.cli.preprocess_data import main
if __name__ == "__main__":
    raise SystemExit(main())
