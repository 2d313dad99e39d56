/*
 * tiny.S: a few dozen instructions of PVH guest, for testing VMM mechanics (boot, pause, capture, restore,
 * dirty tracking, fork) with real KVM on the development machines, whose PVM KVM cannot run a Linux guest
 * (it runs this one, in KVM's instruction emulator: ~1 M instructions/s, which is plenty here).
 *
 * Format: an ELF64 x86-64 file (Firecracker rejects ELF32) whose PT_NOTE carries XEN_ELFNOTE_PHYS32_ENTRY;
 * QEMU (-M microvm -kernel) and Firecracker both enter it the PVH way: 32-bit protected mode, flat
 * segments, paging off, interrupts off.  The code is .code32 and never turns on long mode or paging.
 *
 * It is idle most of the time: the local APIC timer (periodic, vector 0x20) wakes a `hlt` loop every
 * TICK_COUNT APIC bus cycles (KVM's APIC bus runs at 1 GHz: 20,000,000 = 20 ms, 50 ticks/s), so many
 * copies can run on two cores.  Its own GDT and IDT live in its image, so it needs nothing the loader left.
 * KVM's emulator cannot `iret` outside real mode ("emulation failure"), so handlers never return: interrupts
 * are enabled only in the `sti; hlt` of the idle loop, and a handler drops its 3-dword frame and jumps back
 * to that loop.
 *
 * Guest-physical layout (the VM needs >= 8 MiB of RAM):
 *   0x100000  code and tables (this file)
 *   0x200000  status page: "AENVTINY" magic, u32 tick at +8; the stack grows down from the page end, so
 *             the interrupt handler dirties no other page
 *   0x300000  pattern region: 64 pages, every dword = its own address XOR 0x5A5A5A5A (written once at boot)
 *   0x400000  sweep region: 16 pages; at tick t, dword 0 of page (t mod 16) is set to t
 * Serial (COM1, 0x3f8): "AENV BOOT\n" at boot, then one line per tick: "T tttttttt\n" (hex).
 * Plain GNU as syntax (no C preprocessor): `as --64 [--defsym TICK_COUNT=N]`, then `ld -T tiny.ld`.
 */
    .set STATUS, 0x200000
    .set PATTERN, 0x300000
    .set PATTERN_PAGES, 64
    .set SWEEP, 0x400000
    .set SWEEP_PAGES, 16
    .set COM1, 0x3f8
    .set LAPIC, 0xfee00000
    .set TIMER_VECTOR, 0x20
    .ifndef TICK_COUNT
    .set TICK_COUNT, 20000000
    .endif

    .section .note.Xen, "a", @note
    .p2align 2
    .long 4                 /* namesz: "Xen\0" */
    .long 8                 /* descsz: 8 (QEMU reads a size_t from an ELF64 note) */
    .long 18                /* XEN_ELFNOTE_PHYS32_ENTRY */
    .asciz "Xen"
    .quad pvh_start

    .text
    .code32
    .globl pvh_start
pvh_start:
    cli
    cld
    lgdt gdt_desc
    ljmp $0x08, $1f
1:  mov $0x10, %ax
    mov %ax, %ds
    mov %ax, %es
    mov %ax, %ss
    mov %ax, %fs
    mov %ax, %gs
    mov $(STATUS + 0x1000), %esp

    movl $0x564e4541, STATUS        /* "AENV" */
    movl $0x594e4954, STATUS + 4    /* "TINY" */
    movl $0, STATUS + 8

    mov $msg_boot, %esi             /* first: tells the host the guest runs (the fill below is slow) */
    call puts

    /* pattern region */
    mov $PATTERN, %edi
    mov $(PATTERN_PAGES * 1024), %ecx
2:  mov %edi, %eax
    xor $0x5a5a5a5a, %eax
    stosl
    loop 2b

    /* IDT: every vector -> ignore (spurious, stray), the timer vector -> tick */
    mov $idt, %edi
    mov $256, %ecx
3:  mov $ignore, %eax
    call set_gate
    add $8, %edi
    loop 3b
    mov $(idt + TIMER_VECTOR * 8), %edi
    mov $tick, %eax
    call set_gate
    lidt idt_desc

    /* local APIC: software-enable (spurious vector 0xff), periodic timer, divide by 1 */
    movl $0x1ff, LAPIC + 0xf0
    movl $0xb, LAPIC + 0x3e0
    movl $(TIMER_VECTOR | (1 << 17)), LAPIC + 0x320
    movl $TICK_COUNT, LAPIC + 0x380

idle:
    sti
    hlt
    jmp idle

/* set_gate: 32-bit interrupt gate at %edi for handler %eax */
set_gate:
    mov %ax, (%edi)
    movw $0x08, 2(%edi)
    movw $0x8e00, 4(%edi)
    shr $16, %eax
    mov %ax, 6(%edi)
    ret

ignore:
    add $12, %esp                   /* drop EIP, CS, EFLAGS: see the note on iret above */
    movl $0, LAPIC + 0xb0           /* EOI */
    jmp idle

tick:
    add $12, %esp
    mov STATUS + 8, %eax
    inc %eax
    mov %eax, STATUS + 8
    mov %eax, %ebx
    and $(SWEEP_PAGES - 1), %ebx
    shl $12, %ebx
    mov %eax, SWEEP(%ebx)
    mov $msg_t, %esi
    call puts
    call puthex
    mov $'\n', %al
    call putc
    movl $0, LAPIC + 0xb0           /* EOI */
    jmp idle

/* putc: %al to COM1 */
putc:
    push %edx
    mov $COM1, %dx
    outb %al, %dx
    pop %edx
    ret

/* puts: NUL-terminated string at %esi */
puts:
    push %eax
4:  lodsb
    test %al, %al
    jz 5f
    call putc
    jmp 4b
5:  pop %eax
    ret

/* puthex: %eax as 8 hex digits */
puthex:
    push %eax
    push %ecx
    push %edx
    mov $8, %ecx
6:  rol $4, %eax
    mov %eax, %edx
    and $0xf, %edx
    push %eax
    movb hexdigits(%edx), %al
    call putc
    pop %eax
    loop 6b
    pop %edx
    pop %ecx
    pop %eax
    ret

    .section .rodata
    .p2align 3
gdt:
    .quad 0
    .quad 0x00cf9a000000ffff        /* 0x08: code, flat 4 GiB, 32-bit */
    .quad 0x00cf92000000ffff        /* 0x10: data, flat 4 GiB */
gdt_end:
gdt_desc:
    .word gdt_end - gdt - 1
    .long gdt
    .p2align 3
idt_desc:
    .word 256 * 8 - 1
    .long idt
msg_boot:  .asciz "AENV BOOT\n"
msg_t:     .asciz "T "
hexdigits: .ascii "0123456789abcdef"

    .bss
    .p2align 12
idt:
    .space 256 * 8
