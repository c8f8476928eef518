#!/bin/sh
# torpor guest boot script: the kernel runs it as PID 1 (init=/opt/torpor/init.sh).
#
#   init.sh            set up the machine, then exec tini (the reaper) as PID 1 running
#   init.sh supervise  the loop that runs the guest agent and restarts it if it dies.
#
# There is no udev and no systemd in the guest: this script does the little they would do
# (mounts, loading the virtio console module, the /dev/virtio-ports/<name> symlink).

PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
HOME=/root
LANG=C.UTF-8
export PATH HOME LANG

AGENT_PORT_NAME=org.torpor.agent
AGENT_PORT=/dev/virtio-ports/$AGENT_PORT_NAME

log() { echo "torpor-init: $*" > /dev/console 2>/dev/null || echo "torpor-init: $*"; }

# mount_once FSTYPE SOURCE TARGET [OPTIONS]: mount unless already mounted (the initramfs
# moves /proc, /sys, /dev and /run onto the real root before it execs us).
mount_once() {
    mkdir -p "$3"
    grep -q " $3 " /proc/mounts 2>/dev/null && return 0
    mount -t "$1" -o "${4:-defaults}" "$2" "$3"
}

link_agent_port() {
    # udev would create /dev/virtio-ports/<name>; look the name up in sysfs instead.
    mkdir -p /dev/virtio-ports
    for i in $(seq 1 100); do
        for d in /sys/class/virtio-ports/*; do
            [ -r "$d/name" ] || continue
            name=$(cat "$d/name")
            [ -n "$name" ] || continue
            dev=/dev/$(basename "$d")
            [ -e "/dev/virtio-ports/$name" ] || ln -sf "$dev" "/dev/virtio-ports/$name"
        done
        [ -e "$AGENT_PORT" ] && return 0
        sleep 0.1
    done
    log "agent port $AGENT_PORT_NAME did not appear"
    return 1
}

setup() {
    mount_once proc proc /proc
    mount_once sysfs sysfs /sys
    mount_once devtmpfs devtmpfs /dev mode=0755
    mount_once devpts devpts /dev/pts gid=5,mode=620,ptmxmode=666
    mount_once tmpfs tmpfs /dev/shm mode=1777
    mount_once tmpfs tmpfs /run mode=0755
    mount_once tmpfs tmpfs /tmp mode=1777
    mount -o remount,rw / 2>/dev/null
    [ -e /dev/ptmx ] || ln -sf pts/ptmx /dev/ptmx
    [ -e /dev/fd ] || ln -sf /proc/self/fd /dev/fd
    # Drivers that are modules in Debian's kernel: the agent port, 9p shares, vmgenid
    # (so a cloned guest reseeds its RNG), hot-plugged disks.
    for m in virtio_console virtio_blk 9p 9pnet_virtio vmgenid; do
        modprobe -q "$m" 2>/dev/null
    done
    ip link set lo up 2>/dev/null
    hostname "$(cat /etc/hostname 2>/dev/null || echo torpor)" 2>/dev/null
    mkdir -p /workspace
    link_agent_port
}

supervise() {
    # Restart the agent whenever it exits; back off a little so a crash loop cannot spin.
    while true; do
        log "starting agent"
        python3 /opt/torpor/agent.py --port "$AGENT_PORT"
        log "agent exited with status $?; restarting"
        link_agent_port
        sleep 0.5
    done
}

case "$1" in
    supervise)
        supervise
        ;;
    *)
        setup
        log "setup done"
        if command -v tini >/dev/null 2>&1; then
            exec tini -s -- /bin/sh /opt/torpor/init.sh supervise
        fi
        # No reaper installed: run the loop as PID 1 itself (sh reaps its own children only).
        supervise
        ;;
esac
