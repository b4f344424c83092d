from megatron_boost.cli.import_hf import main

if __name__ == "__main__":
    raise SystemExit(main())
