from kvcentric.engine.model.kernels import main

main()
