from gpupool.cli import main

main()
