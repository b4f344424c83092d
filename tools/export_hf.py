from megatron_boost.cli.export_hf import main

if __name__ == "__main__":
    raise SystemExit(main())
