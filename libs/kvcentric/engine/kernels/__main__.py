from kvcentric.engine.kernels import main

main()
