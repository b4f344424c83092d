from megatron_boost.cli.comm_volume import main
if __name__ == "__main__":
    raise SystemExit(main())
