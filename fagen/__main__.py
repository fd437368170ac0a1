from fagen.cli import main

main()
