from shmctl.launch import run

if __name__ == "__main__":
    run()
