from torpor.cli import main

main()
