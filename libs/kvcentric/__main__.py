from kvcentric.cli import main

main()
