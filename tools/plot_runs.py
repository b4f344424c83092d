from megatron_boost.cli.plot_runs import main
if __name__ == "__main__":
    raise SystemExit(main())
